"""The study's TPE sampler with weighted observations: a trial copied from an earlier
study (``autotune.prior`` with a ``weight``, :func:`autotune.results.learn_from_store`)
counts in the Parzen estimators with that weight times the one TPE gives it by its age,
so a reading of a far shape informs the search less than one of this shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from optuna.samplers import TPESampler

from autotune.store import A

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.samplers._tpe.parzen_estimator import _ParzenEstimator
    from optuna.study import Study
    from optuna.trial import FrozenTrial


def observation_weight(t: FrozenTrial) -> float:
    """A trial's weight as an observation: 1, or a prior's recorded ``weight``."""
    prior = t.user_attrs.get(A.PRIOR)
    if isinstance(prior, dict):
        w = prior.get("weight")
        if isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0:
            return float(w)
    return 1.0


class WeightedTPESampler(TPESampler):
    """:class:`optuna.samplers.TPESampler` whose Parzen estimators weigh each trial by
    :func:`observation_weight` (times TPE's own weights): with no weighted prior it samples
    exactly as TPE does. Hooks TPE's ``_build_parzen_estimator`` (Optuna 5; the unit test
    holds the equality with TPE, so a change of that hook fails there)."""

    def _build_parzen_estimator(self, study: Study, search_space: dict[str, BaseDistribution],
                                trials: list[FrozenTrial], handle_below: bool
                                ) -> _ParzenEstimator:
        # the trials TPE's _get_internal_repr keeps: those with every param of the space
        kept = [t for t in trials if search_space.keys() <= self._get_params(t, study).keys()]
        factors = np.array([observation_weight(t) for t in kept], dtype=float)
        if len(kept) == 0 or np.all(factors == 1.0):
            return super()._build_parzen_estimator(study, search_space, trials, handle_below)
        observations = self._get_internal_repr(kept, search_space, study)
        params: Any = self._parzen_estimator_parameters
        if handle_below and study._is_multi_objective():
            base = np.ones(len(kept))
        else:
            base = np.asarray(params.weights(len(kept)), dtype=float)[:len(kept)]
        weights = base * factors
        if not np.any(weights > 0):
            weights = base
        return self._parzen_estimator_cls(observations, search_space, params, weights)
