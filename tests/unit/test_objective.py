"""The objective follows the traffic (autotune.objective): capacity for recorded arrivals, (the pure part: no server, no subprocess; the rest is tests/integration/test_objective.py)"""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config import CAPACITY_DEFAULT_SLO, TuneSettings
from autotune.errors import ConfigError
from autotune.study import is_open_loop, replayed_shape, resolve_objective
from autotune.traffic import load_shape
from tests._objective import CLOSED, OPEN


def _settings(shape: Path, **kw: object) -> TuneSettings:
    return TuneSettings(model=Path("m"), shape=shape, space=Path("s.yaml"), **kw)


def test_auto_is_capacity_for_recorded_arrivals_and_throughput_for_a_closed_loop() -> None:
    open_shape, closed_shape = load_shape(OPEN), load_shape(CLOSED)
    assert is_open_loop(open_shape) and not is_open_loop(closed_shape)
    got = resolve_objective(_settings(OPEN), open_shape)
    assert got.objective == "capacity" and got.measure.slo == CAPACITY_DEFAULT_SLO  # its default SLOs
    assert resolve_objective(_settings(CLOSED), closed_shape).objective == "throughput"
    # given SLOs stay; an explicit objective that the config decides stays as it is
    s = resolve_objective(_settings(OPEN, slo={"ttft_p99": 1.0}), open_shape)
    assert s.objective == "capacity" and s.measure.slo == {"ttft_p99": 1.0}
    s = _settings(OPEN, objective="goodput", slo={"ttft_p99": 1.0})
    assert resolve_objective(s, open_shape) is s
    s = _settings(CLOSED, objective="pareto")
    assert resolve_objective(s, closed_shape) is s


@pytest.mark.parametrize("objective, slo, fragment", [
    ("throughput", {}, "--objective throughput ranks nothing"),
    ("pareto", {}, "--objective pareto ranks nothing"),
    ("goodput", {}, "needs --slo"),
])
def test_an_objective_the_arrivals_decide_is_refused_with_the_ways_out(
        objective: str, slo: dict[str, float], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_objective(_settings(OPEN, objective=objective, slo=slo), load_shape(OPEN))
    msg = str(err.value)
    assert fragment in msg and "\n" not in msg and "5.53 req/s" in msg
    assert "capacity" in msg  # the default way out
    if objective != "goodput":
        assert "--concurrency N" in msg and "--objective goodput --slo" in msg


def test_concurrency_replays_an_open_loop_shape_as_a_closed_loop() -> None:
    shape = load_shape(OPEN)
    s = resolve_objective(_settings(OPEN, concurrency=4), shape)
    assert s.objective == "throughput"  # auto, with a closed-loop load
    s = _settings(OPEN, objective="throughput", concurrency=4)
    assert resolve_objective(s, shape) is s
    closed = replayed_shape(shape, 4)
    assert closed.load.mode == "closed" and closed.load.concurrency == 4
    assert closed.load.requests == shape.load.requests
    assert closed.fingerprint == shape.fingerprint  # the registry still finds it
    assert replayed_shape(shape, None) is shape
    chat = load_shape(CLOSED)
    assert replayed_shape(chat, 2) is chat  # a closed loop keeps its own load


def test_an_unresolved_objective_names_the_fix_instead_of_a_key_error() -> None:
    from autotune.store import objective_metric

    with pytest.raises(ConfigError, match="objective 'auto' names no metric; resolve it from "
                                          "the traffic shape first"):
        objective_metric("auto")
    with pytest.raises(ConfigError, match="use one of throughput, goodput, pareto, capacity"):
        objective_metric("latency")
