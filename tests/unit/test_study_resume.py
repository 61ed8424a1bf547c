"""Resume bookkeeping on a real Optuna storage (SQLite): stopped trials and --trials."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from autotune.store import A, n_finished
from autotune.study import _retry_stopped

DISTS = {"max_num_seqs": IntDistribution(1, 64), "chunked": CategoricalDistribution([True, False])}


def _study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(storage=f"sqlite:///{tmp_path}/o.db", study_name="s",
                               direction="maximize")


def _add(study: optuna.Study, state: TrialState, reason: str | None = None,
         **attrs: object) -> None:
    user = {A.REASON: reason} if reason else {}
    user.update(attrs)
    study.add_trial(optuna.trial.create_trial(
        params={"max_num_seqs": 8 + len(study.trials), "chunked": True}, distributions=DISTS,
        value=1.0 if state == TrialState.COMPLETE else None, state=state, user_attrs=user))


def test_stopped_trials_do_not_count_and_are_retried_once(tmp_path: Path) -> None:
    study = _study(tmp_path)
    _add(study, TrialState.COMPLETE)
    _add(study, TrialState.FAIL, "tuner_died", **{A.BASELINE: True})
    _add(study, TrialState.PRUNED, "oom")  # a failure of the config: it counts
    _add(study, TrialState.FAIL, "interrupted")
    _add(study, TrialState.PRUNED, "rejected")
    _add(study, TrialState.FAIL, "interrupted", **{A.RECHECK_OF: 0})  # left to the re-check
    assert n_finished(study) == 2

    assert _retry_stopped(study) == [1, 3]
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [t.user_attrs[A.RETRY_OF] for t in waiting] == [1, 3]
    assert waiting[0].user_attrs.get(A.BASELINE) is True  # the defaults stay the defaults
    assert not waiting[1].user_attrs.get(A.BASELINE)
    trials = study.trials
    assert [t.system_attrs["fixed_params"] for t in waiting] == [trials[1].params, trials[3].params]

    # A second resume (the retries still waiting) enqueues nothing more.
    assert _retry_stopped(study) == []
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 2

    # The retried config runs when asked next.
    t = study.ask()
    assert t.user_attrs[A.RETRY_OF] == 1
    assert t.suggest_int("max_num_seqs", 1, 64) == trials[1].params["max_num_seqs"]
