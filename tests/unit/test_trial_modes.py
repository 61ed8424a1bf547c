"""A trial's mode (closed loop, open loop, capacity search) is chosen once from its spec
and its replay schedule (autotune.trial._modes); the modes' own figures."""

from __future__ import annotations

from typing import Literal

import pytest

from autotune.traffic import Schedule
from autotune.trial import MODES, CapacitySearch, TrialOutcome, TrialSpec, mode_for
from autotune.trial._replay import _Plan


def _plan(mode: Literal["open", "closed"]) -> _Plan:
    return _Plan(vocab=100, max_len=2048, schedule=Schedule(mode=mode, requests=()))


def _spec(capacity: CapacitySearch | None = None) -> TrialSpec:
    return TrialSpec(number=0, model="m", flags=(), env={}, shape=None, capacity=capacity)


@pytest.mark.parametrize(("capacity", "loop", "mode"), [
    (None, "closed", "closed"), (None, "open", "open"),
    (CapacitySearch(), "open", "capacity"), (CapacitySearch(), "closed", "capacity")])
def test_the_mode_comes_from_the_spec_and_the_schedule(
        capacity: CapacitySearch | None, loop: Literal["open", "closed"], mode: str) -> None:
    chosen = mode_for(_spec(capacity), _plan(loop))
    assert chosen.name == mode and chosen is MODES[mode]


def test_only_the_loops_count_the_prompt_tokens_sent() -> None:
    assert {name: m.counts_prompt_tokens for name, m in MODES.items()} == {
        "closed": True, "open": True, "capacity": False, "sessions": True,
        "session_capacity": False, "exact": True}


def test_a_capacity_trial_adds_its_bracket_s_figures_and_the_loops_none() -> None:
    levels = [{"scale": 1.5, "passed": True, "goodput_fraction": 1.0,
               "output_tokens_per_s": 100.0}]
    cap = {"recorded_rps": 2.0, "low": 1.5, "high": 2.0, "capacity_rps": 3.0,
           "ci_high_rps": 4.0, "levels": levels}
    outcome = TrialOutcome(number=0, ok=True, capacity=cap, gpus=(0, 1))  # type: ignore[arg-type]
    spec = _spec(CapacitySearch())
    got = MODES["capacity"].metrics(spec, outcome)
    assert got["capacity_rps"] == 3.0 and got["capacity_rps_ci_high"] == 4.0
    assert got["gpus_needed"] == pytest.approx(2.0 / 3.0 * 2)  # two GPUs given
    assert MODES["capacity"].metrics(spec, TrialOutcome(number=0, ok=True)) == {}
    assert MODES["closed"].metrics(spec, outcome) == {}
    assert MODES["open"].metrics(spec, outcome) == {}
