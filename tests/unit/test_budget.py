"""The GPU budget (``--budget 2h``): parsing, the plan before trial 0, the account by
phase (pure: no store, no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config import TuneSettings, parse_budget
from autotune.errors import ConfigError
from autotune.study import BudgetPlan, PhaseAccount, TrialCost, phases_line, plan_budget
from autotune.trial import TrialOutcome


@pytest.mark.parametrize(("text", "kind", "seconds"), [
    ("2h", "gpu", 7200.0), ("90m", "gpu", 5400.0), ("5400s", "gpu", 5400.0),
    ("1.5H", "gpu", 5400.0), (" 30 m ", "gpu", 1800.0), ("3600", "wall", 3600.0),
    ("0.5h", "gpu", 1800.0), (120, "wall", 120.0)])
def test_budget_takes_gpu_time_with_a_unit_and_wall_seconds_without(
        text: str, kind: str, seconds: float) -> None:
    assert parse_budget(text) == (kind, seconds)


@pytest.mark.parametrize("text", ["", "2d", "-1h", "0h", "h", "two hours", "1e3", "nan"])
def test_a_budget_that_is_no_time_says_both_ways(text: str) -> None:
    with pytest.raises(ConfigError, match=r"--budget .*2h, 90m, 5400s.*bare number"):
        parse_budget(text)


def _settings(**kw: object) -> TuneSettings:
    return TuneSettings(model=Path("m"), shape=Path("s"), space=Path("x"), **kw)


def test_settings_route_budget_to_gpu_seconds_or_the_wall_timeout() -> None:
    s = _settings(budget="2h")
    assert s.gpu_budget_s == 7200.0 and s.timeout_s is None
    s = _settings(budget="900")
    assert s.timeout_s == 900.0 and s.gpu_budget_s is None
    assert TuneSettings(**s.model_dump()).timeout_s == 900.0  # a saved config loads again
    with pytest.raises(ValueError, match="--budget 900 and --timeout 60"):
        _settings(budget="900", timeout_s=60)


def test_the_plan_reserves_the_recheck_and_says_what_fits() -> None:
    plan = plan_budget(budget_s=7200, cost=TrialCost(300.0, trials=12, studies=2), trials=30,
                       recheck=3, recheck_starts=2)
    assert (plan.starts, plan.recheck, plan.trials) == (24, 8, 16)
    line = plan.line()
    assert line.startswith("budget: about 16 trials and 24 server starts fit in 2 GPU-hours "
                           "at about 300 s a start (the median of 12 earlier trial(s) of 2 "
                           "studies on this engine and hardware; 8 of the starts re-check")
    assert "--trials 30 will not all fit" in line


def test_a_plan_counts_every_gpu_of_a_trial_and_says_when_trials_end_first() -> None:
    plan = plan_budget(budget_s=5400, cost=TrialCost(60.0), trials=5, recheck=0,
                       recheck_starts=2, gpus_per_trial=2)
    assert (plan.starts, plan.recheck, plan.trials) == (45, 0, 45)
    assert "90 GPU-minutes" not in plan.line()  # 1.5 GPU-hours
    assert "1.5 GPU-hours" in plan.line() and "a first guess" in plan.line()
    assert "--trials 5 ends the search first" in plan.line()


def test_a_budget_smaller_than_the_recheck_leaves_no_search_trial() -> None:
    plan = plan_budget(budget_s=600, cost=TrialCost(300.0), trials=10, recheck=3,
                       recheck_starts=2)
    assert isinstance(plan, BudgetPlan)
    assert (plan.starts, plan.recheck, plan.trials) == (2, 2, 0)
    assert "10.0 GPU-minutes" in plan.line() or "10 GPU-minutes" in plan.line()


def _outcome(ok: bool = True, wall: float = 100.0, gpus: tuple[int, ...] | None = None,
             start: float = 40.0, warm: float = 20.0, meas: float = 30.0) -> TrialOutcome:
    return TrialOutcome(number=0, ok=ok, wall_s=wall, gpus=gpus, start_s=start,
                        warmup_s=warm, measure_s=meas)


def test_the_account_splits_search_trials_and_keeps_pruned_and_recheck_whole() -> None:
    acct = PhaseAccount(budget_s=3600.0)
    acct.add(_outcome(gpus=(0, 1)), kind="search", server_gpus=2)  # 200 GPU-seconds
    acct.add(_outcome(ok=False, wall=50.0, start=50.0, warm=0.0, meas=0.0), kind="search")
    acct.add(_outcome(wall=60.0), kind="pruned")
    acct.add(_outcome(wall=80.0), kind="recheck")
    rec = acct.record()
    assert rec["starts"] == 80.0 + 50.0 and rec["warmup"] == 40.0 and rec["measuring"] == 60.0
    assert rec["other"] == 20.0 and rec["pruned"] == 60.0 and rec["recheck"] == 80.0
    assert rec["screened"] == 0.0
    assert rec["total"] == 200.0 + 50.0 + 60.0 + 80.0
    assert rec["pruned_saved"] == 200.0 - 60.0  # the full trial's cost less what it spent
    assert acct.mean_trial() == rec["total"] / 4
    line = phases_line(rec)
    assert line.startswith("GPU-seconds by phase: starts 130, warm-up 40, measuring 60, "
                           "other 20, screened 0, pruned 60, re-check 80 (total 390 = 0.11 "
                           "GPU-hours of a 1 GPU-hour budget)")
    assert "pruned trials saved about 140 GPU-seconds" in line
