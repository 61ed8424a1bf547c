"""Parameter importances (fANOVA) of a study's own measured trials: the report's
"what mattered" and the study's importance plot (``autotune.results``) read them here."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from autotune.store import is_prior

if TYPE_CHECKING:
    from optuna import Study

__all__ = ["MIN_IMPORTANCE_TRIALS", "param_importances"]

logger = logging.getLogger(__name__)


#: measured trials before parameter importances are shown: fANOVA fits a random forest to
#: the trials' (params, objective) pairs, and on fewer points each tree splits on one or
#: two readings, so the ranking says more about the noise of a reading (or the forest's
#: seed) than about the knobs; an Optuna study samples its first few configs at random
#: anyway (TPE's start-up), and a study of at least 5 has seen several settings of a knob
MIN_IMPORTANCE_TRIALS = 5


def param_importances(study: Study) -> tuple[dict[str, float] | None, str, int]:
    """(importances, why not, trials used) over this study's own COMPLETE trials. "Why
    not" is a sentence for people (the report, the PNG), never the library's error."""
    import optuna  # heavy: loaded when a report or a plot needs it
    from optuna.trial import TrialState

    trials = [t for t in study.get_trials(deepcopy=False)
              if t.state == TrialState.COMPLETE and not is_prior(t)
              and t.values and math.isfinite(t.values[0])]
    if len(trials) < MIN_IMPORTANCE_TRIALS:
        return None, (f"parameter importances need at least {MIN_IMPORTANCE_TRIALS} measured "
                      f"trials (this study has {len(trials)}): from fewer, the ranking would "
                      "be the noise of single readings"), len(trials)
    varied = {k for t in trials for k in t.params
              if len({repr(u.params.get(k)) for u in trials}) > 1}
    if not varied:
        return None, ("no parameter varied across the measured trials: nothing to attribute "
                      "the variance of the objective to"), len(trials)
    if len({t.values[0] for t in trials}) == 1:
        return None, (f"every measured trial read the same objective ({trials[0].values[0]:g}): "
                      "no variance to attribute to the parameters"), len(trials)
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        own = optuna.create_study(directions=study.directions)
        own.add_trials(trials)
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
        target = (lambda t: t.values[0]) if len(study.directions) > 1 else None
        imp = optuna.importance.get_param_importances(own, evaluator=evaluator, target=target)
    except (RuntimeError, ValueError, ImportError) as exc:
        # e.g. "Encountered zero total variance in all trees": the forest found no split
        # that explains the readings; people get what that means, the log gets the error
        logger.info("parameter importances of study %s: %s: %s", study.study_name,
                    type(exc).__name__, exc)
        if isinstance(exc, ImportError):
            return None, ("parameter importances need Optuna's fANOVA evaluator, which does "
                          "not import here"), len(trials)
        return None, (f"parameter importances could not be computed from these {len(trials)} "
                      "measured trials: the readings vary too little with the parameters for "
                      "fANOVA to attribute any of it (more trials may)"), len(trials)
    finally:
        optuna.logging.set_verbosity(verbosity)
    if not imp:
        why = ("no parameter varied across the measured trials that all of them have "
               "(conditional knobs count only where present in every trial)")
        return None, why, len(trials)
    return dict(imp), "", len(trials)
