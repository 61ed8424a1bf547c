"""What a study stores in Optuna, and the rules every reader of a study applies to it.

The bottom of the study layer (Optuna's ``_constrained_optimization.py`` plays this part in
Optuna): :mod:`autotune.study` writes these attributes, :mod:`autotune.results`
(registry, plots), the experiments and the tests read them. It imports nothing of
autotune but :mod:`autotune.errors`, the pure :mod:`autotune.measure` statistics (the verdict's
interval) and the leaf :mod:`autotune.hardware` (is a tuner's process still running), so
no reader needs the orchestrator.

How trials are stored:

* a measured trial is ``COMPLETE`` with the objective as its value and constraint values
  (failed, SLO, error-rate and quality violations; > 0 means infeasible) that the sampler
  learns from;
* a trial whose server failed (invalid flags, out of memory, crash, start timeout, ...) or
  whose sample broke a rule of the space is ``PRUNED`` with a constraint violation of 1 and
  the reason in ``user_attrs["autotune.reason"]``: the TPE sampler treats it as an
  infeasible point and learns to avoid the region; it is never scored as throughput 0;
* a trial the pruner stopped as a clear loser (its interval lay wholly below the
  incumbent's) is ``PRUNED`` with its segment rates as intermediate values, constraints
  of 0 and state and reason ``pruned``: TPE ranks pruned trials after every complete one,
  so the sampler learns that the region is worse than what it has, without a made-up
  value;
* a trial that was running when the tuner died is ``FAIL`` with reason ``tuner_died`` (or
  ``interrupted`` after SIGINT/SIGTERM, ``stale`` when its tuner on another host, or a hung
  one, stopped sending heartbeats); such a trial says nothing about its config, so it
  does not count toward ``--trials`` and ``--resume`` runs its config again; so is a
  queued config the time budget left unstarted (reason ``budget``).

Several tuners may work on one study (one storage: PostgreSQL, or one SQLite file): each
running trial carries its tuner (``autotune.owner``: host, pid, process start, session
token) and gets Optuna heartbeats from :class:`Heartbeats`; :func:`fail_stale_trials`
fails only the trials whose tuner is gone (see there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.store._heartbeats import (
        Heartbeat,
        Heartbeats,
        Owner,
        OwnerRecord,
        fail_stale_trials,
    )
    from autotune.store._keys import (
        STOPPED,
        A,
        FailureReason,
        State,
        interval_keys,
        objective_label,
        objective_metric,
    )
    from autotune.store._spread import (
        CPU_DEFAULT_SPREAD,
        SpreadRecord,
        StoredSpread,
        keep_spread,
        prior_spread_of,
        record_spread,
        stored_spread,
    )
    from autotune.store._storage import (
        latest_study,
        open_storage,
        schema_race,
        sqlite_path,
    )
    from autotune.store._trials import (
        baseline_trial,
        best_trial,
        failures_by_reason,
        feasible,
        is_prior,
        mark_failed,
        mlflow_run,
        n_finished,
        primary,
        readings,
        rung_counts,
        server_gpus_of,
        set_constraints,
    )
    from autotune.store._verdict import (
        VerdictRecord,
        capacity_cut,
        judge_study,
        pareto_front,
        pareto_trials,
        verdict,
        verdict_record,
    )

__all__ = [
    "CPU_DEFAULT_SPREAD",
    "STOPPED",
    "A",
    "FailureReason",
    "Heartbeat",
    "Heartbeats",
    "Owner",
    "OwnerRecord",
    "SpreadRecord",
    "State",
    "StoredSpread",
    "VerdictRecord",
    "baseline_trial",
    "best_trial",
    "capacity_cut",
    "fail_stale_trials",
    "failures_by_reason",
    "feasible",
    "interval_keys",
    "is_prior",
    "judge_study",
    "keep_spread",
    "latest_study",
    "mark_failed",
    "mlflow_run",
    "n_finished",
    "objective_label",
    "objective_metric",
    "open_storage",
    "pareto_front",
    "pareto_trials",
    "primary",
    "prior_spread_of",
    "readings",
    "record_spread",
    "rung_counts",
    "schema_race",
    "server_gpus_of",
    "set_constraints",
    "sqlite_path",
    "stored_spread",
    "verdict",
    "verdict_record",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.store._heartbeats": ("Heartbeat", "Heartbeats", "Owner", "OwnerRecord",
                                      "fail_stale_trials"),
    "autotune.store._keys": (
        "A",
        "FailureReason",
        "STOPPED",
        "State",
        "interval_keys",
        "objective_label",
        "objective_metric",
    ),
    "autotune.store._spread": ("CPU_DEFAULT_SPREAD", "SpreadRecord", "StoredSpread",
                               "keep_spread", "prior_spread_of", "record_spread",
                               "stored_spread"),
    "autotune.store._storage": ("latest_study", "open_storage", "schema_race", "sqlite_path"),
    "autotune.store._trials": (
        "baseline_trial",
        "best_trial",
        "failures_by_reason",
        "feasible",
        "is_prior",
        "mark_failed",
        "mlflow_run",
        "n_finished",
        "primary",
        "readings",
        "rung_counts",
        "server_gpus_of",
        "set_constraints",
    ),
    "autotune.store._verdict": (
        "VerdictRecord",
        "capacity_cut",
        "judge_study",
        "pareto_front",
        "pareto_trials",
        "verdict",
        "verdict_record",
    ),
})
