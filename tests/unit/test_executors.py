"""One contract suite run against every :class:`autotune.exec.Executor`: inline, simulated
(slots, and a node of GPUs) and Ray (slow: a local Ray start)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from autotune.exec import Executor, InlineExecutor
from autotune.parallelism import Node
from autotune.testing import SimulatedExecutor
from autotune.trial import TrialOutcome, TrialSpec


def _spec(number: int, server_gpus: int = 1) -> TrialSpec:
    return TrialSpec(number=number, model="m", flags=(), env={}, shape=None,
                     server_gpus=server_gpus)


def _done(spec: TrialSpec) -> TrialOutcome:
    return TrialOutcome(number=spec.number, ok=True, metrics={"x": float(spec.number)})


def _slow(spec: TrialSpec) -> TrialOutcome:
    time.sleep(2.0)  # in flight long enough to be counted and cancelled (Ray)
    return _done(spec)


def _inline() -> Executor:
    return InlineExecutor(fn=_done)


def _sim_slots() -> Executor:
    return SimulatedExecutor(lambda params, spec: {"x": float(spec.number)}, slots=2)


def _sim_gpus() -> Executor:
    return SimulatedExecutor(lambda params, spec: {"x": float(spec.number)}, gpus=2,
                             gpu_memory_gib=24.0)


def _ray() -> Executor:
    from autotune.exec import RayExecutor

    return RayExecutor(fn=_slow, slots=2)


MAKERS: dict[str, Callable[[], Executor]] = {
    "inline": _inline, "simulated-slots": _sim_slots, "simulated-gpus": _sim_gpus,
    "ray": _ray}


@pytest.fixture(params=[
    "inline", "simulated-slots", "simulated-gpus",
    pytest.param("ray", marks=pytest.mark.slow)])  # a local Ray start: about 10 s
def executor(request: pytest.FixtureRequest) -> Iterator[Executor]:
    ex = MAKERS[request.param]()
    try:
        yield ex
    finally:
        ex.shutdown()


def test_every_executor_is_one(executor: Executor) -> None:
    assert isinstance(executor, Executor)
    assert isinstance(executor.slots, int) and executor.slots >= 1
    node = executor.gpu_node()
    assert node is None or (isinstance(node, Node) and node.gpus >= 1)
    need = executor.reservation(_spec(0))
    assert isinstance(need, int) and need >= 0
    assert (need == 0) == (executor.pool is None)


def test_an_idle_executor_has_room_and_nothing_in_flight(executor: Executor) -> None:
    assert executor.in_flight() == 0
    assert executor.has_room() is True
    assert executor.fits(_spec(0)) is True
    assert executor.wait(timeout_s=0.0) == []
    assert executor.cancel_all() == []


def test_a_full_executor_has_no_room_until_its_trials_are_cancelled(
        executor: Executor) -> None:
    numbers = list(range(1, executor.slots + 1))
    for n in numbers:
        assert executor.fits(_spec(n))
        executor.submit(_spec(n))
    assert executor.in_flight() == executor.slots
    assert executor.fits(_spec(99)) is False
    assert executor.has_room() is False
    assert sorted(executor.cancel_all()) == numbers
    assert executor.in_flight() == 0
    assert executor.has_room() is True and executor.fits(_spec(99)) is True


def test_a_submitted_trial_comes_back_from_wait(executor: Executor) -> None:
    executor.submit(_spec(5))
    done: list[TrialOutcome] = []
    deadline = time.monotonic() + 120
    while not done and time.monotonic() < deadline:
        done = executor.wait(timeout_s=1.0)
    [outcome] = done
    assert outcome.number == 5 and outcome.ok
    assert outcome.metrics["x"] == 5.0
    assert executor.in_flight() == 0 and executor.has_room()


def test_a_trial_larger_than_the_node_never_fits() -> None:
    from autotune.exec import never_fits

    sim = _sim_gpus()
    assert never_fits(sim, _spec(1, server_gpus=2)) is None
    assert "needs 3 GPUs of one node, but the largest node has 2" in (
        never_fits(sim, _spec(1, server_gpus=3)) or "")
    assert never_fits(_inline(), _spec(1, server_gpus=8)) is None  # no GPU bookkeeping
