"""Capacity studies built in memory (Optuna's in-memory storage, FrozenTrials by
``create_trial``): the readings a capacity verdict judges, for tests/unit."""

from __future__ import annotations

from typing import Any

#: (max_num_seqs or None for the defaults, capacity req/s, bracket top or None,
#:  recheck_of or None, search status[, GPUs per server])
Reading = tuple[Any, ...]


def capacity_study(readings: list[Reading], *, recorded_rps: float = 5.53) -> Any:
    """A capacity study of ``readings`` in trial order (the value per GPU, the metrics and
    ``autotune.capacity`` per server, as a study stores them)."""
    import optuna
    from optuna.distributions import IntDistribution
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    study.set_user_attr("autotune.settings", {"objective": "capacity"})
    for seqs, value, hi, recheck_of, status, *gpus in readings:
        n = gpus[0] if gpus else 1
        metrics: dict[str, float] = {
            "capacity_rps": value, "capacity_rps_ci_low": value,
            "capacity_recorded_rps": recorded_rps,
            "servers_needed": recorded_rps / value, "gpus_needed": recorded_rps / value * n}
        if hi is not None:
            metrics["capacity_rps_ci_high"] = hi
        attrs: dict[str, object] = {
            "autotune.state": "ok", "autotune.metrics": metrics, "autotune.server_gpus": n,
            "autotune.capacity": {"recorded_rps": recorded_rps, "low": value / recorded_rps,
                                  "high": hi / recorded_rps if hi is not None else None,
                                  "status": status, "levels": []}}
        if seqs is None:
            attrs["autotune.baseline"] = True
        if recheck_of is not None:
            attrs["autotune.recheck_of"] = recheck_of
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, value=value / n, user_attrs=attrs,
            params={} if seqs is None else {"max_num_seqs": seqs},
            distributions={} if seqs is None else {"max_num_seqs": IntDistribution(1, 64)}))
    return study
