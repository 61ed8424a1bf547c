"""--objective capacity: the bracketing search (pure) and load levels against the stub (the pure part: no server, no subprocess; the rest is tests/integration/test_capacity.py)"""

from __future__ import annotations

import json
import math
import random
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from autotune.errors import ConfigError
from autotune.measure import Slo
from autotune.trial import (
    CapacityRecord,
    CapacitySearch,
    Level,
    LevelRecord,
    level_abort,
    recorded_rate,
    search_capacity,
)
from tests._capacity import SHAPE
from tests.conftest import REPO


def _level(scale: float, passed: bool) -> Level:
    return Level(scale=scale, offered_rps=scale, passed=passed,
                 goodput_fraction=1.0 if passed else 0.5, error_rate=0.0)


def _monotone(true_scale: float, calls: list[float] | None = None):  # type: ignore[no-untyped-def]
    def probe(scale: float) -> Level:
        if calls is not None:
            calls.append(scale)
        return _level(scale, scale <= true_scale)
    return probe


def test_capacity_records_name_the_keys_that_are_stored() -> None:
    # outcome.capacity and its levels are stored (autotune.capacity, bench's JSON): the typed
    # records name exactly the keys to_dict() writes (and the trial adds), as JSON
    res = search_capacity(_monotone(2.5), recorded_rps=2.0)
    d = res.to_dict(0.99)
    added = {"level_s", "level_s_asked", "level_note", "start", "start_note"}  # by the trial
    sessions = {"recorded_sps", "capacity_sps", "ci_high_sps"}  # a session search's
    assert set(CapacityRecord.__annotations__) == set(d) | added | sessions
    assert not added & set(d) and not sessions & set(d)
    d_s = search_capacity(_monotone(2.5), recorded_rps=2.0, recorded_sps=0.5).to_dict(0.99)
    assert set(d_s) == set(d) | sessions and d_s["capacity_sps"] == pytest.approx(
        0.5 * res.low)
    assert set(LevelRecord.__annotations__) == {f.name for f in fields(Level)} == set(
        d["levels"][0])
    assert json.loads(json.dumps(d)) == d and d["capacity_rps"] == pytest.approx(2.0 * res.low)


@pytest.mark.parametrize("true_scale", [0.03, 0.3, 0.99, 1.0, 1.7, 5.0, 37.0])
def test_monotone_capacity_is_bracketed_within_tolerance(true_scale: float) -> None:
    s = CapacitySearch(tolerance=0.1, max_levels=20)
    res = search_capacity(_monotone(true_scale), recorded_rps=2.0, search=s)
    assert res.status == "found"
    assert res.low is not None and res.high is not None
    assert res.low <= true_scale < res.high
    assert res.high / res.low - 1 <= 0.1
    assert res.capacity_rps == pytest.approx(2.0 * res.low)
    assert res.ci_high_rps == pytest.approx(2.0 * res.high)
    # every level is recorded, in order; the capacity rests on a passing one
    at = res.at_capacity()
    assert at is not None and at.passed and at.scale == res.low


def test_search_starts_at_start_and_doubles_then_bisects() -> None:
    calls: list[float] = []
    res = search_capacity(_monotone(3.0, calls), recorded_rps=1.0,
                          search=CapacitySearch(tolerance=0.05))
    assert calls[:3] == [1.0, 2.0, 4.0]  # expand: pass, pass, fail
    assert all(2.0 < c < 4.0 for c in calls[3:])  # then only inside the bracket
    assert res.status == "found" and len(res.levels) == len(calls)


def test_a_start_near_the_capacity_steps_by_the_tolerance_then_doubles() -> None:
    calls: list[float] = []
    res = search_capacity(_monotone(3.0, calls), recorded_rps=1.0,
                          search=CapacitySearch(tolerance=0.25, step=1.25))
    # steps up of 1.25x, 1.5625x, then 2x (the square of the last, at most 2): pass, pass,
    # pass, fail
    assert calls[:4] == pytest.approx([1.0, 1.25, 1.953125, 3.90625])
    assert all(1.953125 < c < 3.90625 for c in calls[4:])  # then only inside the bracket
    assert res.status == "found" and len(res.levels) == len(calls)
    assert res.low is not None and res.high is not None and res.high / res.low <= 1.25
    with pytest.raises(ConfigError, match="capacity step"):
        CapacitySearch(step=1.0)


@pytest.mark.parametrize("true_scale", [0.85, 0.9, 0.99])
def test_a_start_just_under_the_capacity_closes_the_bracket_in_two_levels(
        true_scale: float) -> None:
    # the warm-up puts the first level one tolerance step below the server's saturation:
    # a capacity within that step is bracketed 1.25x wide by the next level
    res = search_capacity(_monotone(true_scale), recorded_rps=1.0,
                          search=CapacitySearch(start=0.8, tolerance=0.25, step=1.25))
    assert res.status == "found" and len(res.levels) == 2
    assert (res.low, res.high) == (0.8, pytest.approx(1.0))


def test_never_passing_ends_at_min_scale_with_no_capacity() -> None:
    res = search_capacity(lambda s: _level(s, False), recorded_rps=4.0,
                          search=CapacitySearch(min_scale=1 / 8, max_levels=20))
    assert res.status == "none" and res.low is None and res.capacity_rps is None
    assert res.high == pytest.approx(1 / 8)
    assert [lv.scale for lv in res.levels] == [1.0, 0.5, 0.25, 0.125]
    assert "no load level met the SLOs" in res.summary()
    assert "even the lowest rate searched (0.125x" in res.summary(CapacitySearch(
        min_scale=1 / 8))


def test_always_passing_is_capped_at_max_scale() -> None:
    res = search_capacity(lambda s: _level(s, True), recorded_rps=1.5,
                          search=CapacitySearch(max_scale=8.0, max_levels=20))
    assert res.status == "capped" and res.high is None and res.ci_high_rps is None
    assert res.low == 8.0 and res.capacity_rps == pytest.approx(12.0)
    assert [lv.scale for lv in res.levels] == [1.0, 2.0, 4.0, 8.0]
    why = res.summary(CapacitySearch(max_scale=8.0))
    assert "capacity at least 12 req/s" in why and "still met the SLOs" in why
    assert "?" not in why and "inf" not in why


def test_level_budget_leaves_a_wider_bracket() -> None:
    res = search_capacity(_monotone(1.3), recorded_rps=1.0,
                          search=CapacitySearch(tolerance=0.001, max_levels=4))
    assert res.status == "levels" and len(res.levels) == 4
    assert res.low is not None and res.high is not None and res.low <= 1.3 < res.high
    assert [lv.scale for lv in res.levels] == pytest.approx([1.0, 2.0, 2 ** 0.5, 2 ** 0.25])
    assert "--capacity-max-levels 4 levels were spent" in res.summary(
        CapacitySearch(tolerance=0.001, max_levels=4))


def test_noisy_edge_keeps_a_consistent_bracket() -> None:
    """Pass/fail is a coin toss within +-5 % of the true capacity: the bracket stays
    ordered and lands within the noise band plus the tolerance."""
    for seed in range(30):
        rng = random.Random(seed)

        def probe(scale: float) -> Level:
            if abs(scale / 2.5 - 1) <= 0.05:
                return _level(scale, rng.random() < 0.5)
            return _level(scale, scale < 2.5)

        res = search_capacity(probe, recorded_rps=1.0, search=CapacitySearch(tolerance=0.05))
        assert res.low is not None and res.high is not None and res.low < res.high
        assert 2.5 * 0.95 / 1.05 <= res.low <= 2.5 * 1.05
        # each level's verdict agrees with the bracket: passes at or below low, fails at
        # or above high (the search never probes outside the current bracket)
        assert max(lv.scale for lv in res.levels if lv.passed) == res.low
        assert min(lv.scale for lv in res.levels if not lv.passed) == res.high


@pytest.mark.parametrize("bad", [
    {"goodput": 0.0}, {"goodput": 1.5}, {"tolerance": 0.0}, {"tolerance": 1.0},
    {"start": 100.0}, {"min_scale": 0.0}, {"max_levels": 1}, {"start": math.nan},
])
def test_bad_search_settings_say_what_is_wrong(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="capacity|error rate"):
        CapacitySearch(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_search_needs_a_recorded_rate(rate: float) -> None:
    with pytest.raises(ConfigError, match="recorded rate"):
        search_capacity(_monotone(1.0), recorded_rps=rate)


def test_closed_loop_shape_is_a_one_line_error() -> None:
    from autotune.traffic import load_shape
    from tests.conftest import REPO

    shape = load_shape(REPO / "traffic" / "casestudy-512x512.json")
    with pytest.raises(ConfigError) as err:
        recorded_rate(shape)
    msg = str(err.value)
    assert "capacity (--objective capacity, bench --capacity) needs a shape with arrivals" in msg
    assert "\n" not in msg
    assert "autotune shape fit" in msg
    assert recorded_rate(load_shape(REPO / "traffic" / "azure-conv.json")) > 0


def test_level_abort_stops_once_a_level_cannot_pass() -> None:
    from autotune.load import RequestRecord

    def rec(i: int, ttft: float, ok: bool = True) -> RequestRecord:
        return RequestRecord(index=i, send_s=0.0, first_token_s=ttft, end_s=ttft + 0.1,
                             chunk_times_s=(ttft, ttft + 0.1), chunk_tokens=(1, 1),
                             prompt_tokens=4, output_tokens=2, ok=ok,
                             error=None if ok else "timeout", detail=None, status=200)

    check = level_abort(200, Slo(ttft_s=1.0), CapacitySearch(goodput=0.99))
    for i in range(5):  # 5 misses of 200 allowed: not credibly above 1 %
        assert check(rec(i, 2.0), i + 1, 0) is None
    why = check(rec(5, 2.0), 6, 0)
    assert why is not None and "6 of 200 requests missed the SLOs" in why
    assert "(at most 5 may)" in why
    errs = level_abort(100, None, CapacitySearch(goodput=0.5, max_error_rate=0.01))
    for i in range(3):  # 3 failures of 100 at a 1 % error bar
        assert errs(rec(i, 0.1, ok=False), i + 1, i + 1) is None
    assert "4 of 100 requests failed" in (errs(rec(3, 0.1, ok=False), 4, 4) or "")


def test_a_level_is_judged_on_enough_requests() -> None:
    """The binomial rule: a level fails only when its misses are credibly above the bar's
    allowance, so one slow request does not fail a level of 56 at the 99 % bar."""
    from autotune.measure import allowed_misses
    from autotune.trial._levels import level_allows

    assert [allowed_misses(n, 0.01) for n in (10, 40, 56, 100, 1000)] == [1, 2, 2, 3, 15]
    assert allowed_misses(56, 0.0) == 0 and allowed_misses(0, 0.01) == 0
    assert allowed_misses(10, 1.0) == 10
    for n in (40, 56, 100, 400, 2000):  # never stricter than the share itself
        assert allowed_misses(n, 0.01) >= math.floor(0.01 * n)
        # a server missing 3x the allowance fails a level of 400 or more
        if n >= 400:
            assert allowed_misses(n, 0.01) < 0.03 * n
    assert level_allows(56, CapacitySearch(goodput=0.99, max_error_rate=0.05)) == (2, 6)
    assert level_allows(56, CapacitySearch(goodput=1.0)) == (0, 6)


def test_a_level_names_the_requests_that_missed_by_most() -> None:
    from dataclasses import replace

    from autotune.load import RequestRecord
    from autotune.trial._levels import worst_misses

    def rec(i: int, ttft: float, ok: bool = True, session: int | None = None
            ) -> RequestRecord:
        return RequestRecord(index=i, send_s=0.0, first_token_s=ttft, end_s=ttft + 0.1,
                             chunk_times_s=(ttft, ttft + 0.1), chunk_tokens=(1, 1),
                             prompt_tokens=4, output_tokens=2, ok=ok,
                             error=None if ok else "timeout", detail=None, status=200)

    recs = [rec(0, 0.5), rec(1, 1.5), rec(2, 3.0, ok=False), rec(3, 4.0),
            replace(rec(4, 2.5), session=7, turn=1)]
    worst = worst_misses(recs, Slo(ttft_s=1.0))
    assert worst == ["request 3: ttft 4 s > 1 s",
                     "request 4 (session 7, turn 2): ttft 2.5 s > 1 s",
                     "request 1: ttft 1.5 s > 1 s", "request 2: failed (timeout)"]
    assert worst_misses(recs[:1], Slo(ttft_s=1.0)) == []
    lv = Level(scale=1.0, offered_rps=4.0, passed=False, goodput_fraction=0.9,
               error_rate=0.0, worst_misses=worst, remeasured=True)
    out = lv.outcome()
    assert "measured again, as no level had passed" in out
    assert "worst: request 3: ttft 4 s > 1 s; request 4" in out
    assert lv.to_dict()["worst_misses"] == worst


def test_a_config_failing_every_level_is_measured_once_more() -> None:
    from autotune.trial._levels import remeasure_lowest

    runs: list[float] = []

    def probe(scale: float) -> Level:  # fails every level the first time, passes again
        runs.append(scale)
        passed = runs.count(scale) > 1
        return Level(scale=scale, offered_rps=scale, passed=passed,
                     goodput_fraction=1.0 if passed else 0.9, error_rate=0.0)

    search = CapacitySearch(max_levels=3, tolerance=0.25)
    res = search_capacity(probe, recorded_rps=1.0, search=search)
    assert res.low is None and [lv.scale for lv in res.levels] == [1.0, 0.5, 0.25]
    remeasure_lowest(probe, res, search)
    assert runs[-1] == 0.25 and res.levels[-1].remeasured and res.levels[-1].passed
    assert (res.low, res.high, res.status) == (0.25, 0.5, "levels")
    # still failing: the config stays without capacity
    res2 = search_capacity(lambda s: Level(scale=s, offered_rps=s, passed=False,
                                           goodput_fraction=0.0, error_rate=0.0),
                           recorded_rps=1.0, search=search)
    remeasure_lowest(lambda s: Level(scale=s, offered_rps=s, passed=False,
                                     goodput_fraction=0.0, error_rate=0.0), res2, search)
    assert res2.low is None and len(res2.levels) == 4 and res2.levels[-1].remeasured


def test_bench_capacity_needs_arrivals(fake_model: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    assert main(["bench", "--model", str(fake_model), "--shape",
                 str(REPO / "traffic" / "casestudy-512x512.json"), "--capacity"]) == 2
    err = capsys.readouterr().err
    assert "needs a shape with arrivals" in err and err.count("\n") == 1


def _judged(outcome: Any, **settings: Any) -> tuple[Any, Any, Any, Any]:
    import optuna

    from autotune.config import TuneSettings
    from autotune.study import judge

    s = TuneSettings(model=Path("m"), shape=SHAPE, space=Path("s.yaml"),
                     objective="capacity", **settings)
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    value, state, reason = judge(trial, outcome, s)
    return value, state, reason, trial


def _cap_outcome(low: float | None, high: float | None) -> Any:
    from autotune.trial import TrialOutcome, _capacity_metrics

    levels = [{"scale": x, "passed": x == low, "goodput_fraction": 1.0 if x == low else 0.5,
               "output_tokens_per_s": 100.0} for x in (low, high) if x is not None]
    cap = {"recorded_rps": 2.0, "low": low, "high": high,
           "capacity_rps": None if low is None else 2.0 * low,
           "ci_high_rps": None if high is None else 2.0 * high, "levels": levels}
    metrics = {**_capacity_metrics(cap, (0, 1)), "error_rate": 0.0, "ttft_p99_s": 9.0}
    return TrialOutcome(number=0, ok=True, metrics=metrics, capacity=cap,
                        message="no load level met the SLOs" if low is None else "")


def test_a_capacity_trial_is_judged_by_its_bracket_not_its_percentiles() -> None:
    value, state, reason, trial = _judged(_cap_outcome(1.5, 2.0), slo={"ttft_p99": 2.0})
    # its p99 TTFT (9 s) is over the SLO, but 99 % of the requests met it at 3 req/s
    assert (value, state, reason) == (3.0, "ok", None)
    m = trial.user_attrs["autotune.metrics"]
    assert (m["capacity_rps"], m["capacity_rps_ci_low"], m["capacity_rps_ci_high"]) == (3.0, 3.0, 4.0)
    assert m["output_tokens_per_s_at_capacity"] == 100.0
    assert m["servers_needed"] == pytest.approx(2.0 / 3.0)
    assert m["gpus_needed"] == pytest.approx(4.0 / 3.0)  # two GPUs per server
    assert trial.user_attrs["autotune.capacity"]["low"] == 1.5


def test_no_passing_level_is_infeasible_never_a_capacity_of_zero() -> None:
    value, state, reason, trial = _judged(_cap_outcome(None, 1 / 64))
    assert (state, reason) == ("infeasible", "slo") and value == pytest.approx(2.0 / 64)
    assert trial.user_attrs["autotune.constraints"][1] > 0
    assert "no load level met the SLOs" in trial.user_attrs["autotune.message"]


def test_capacity_without_slo_judges_the_stated_defaults() -> None:
    from autotune.config import CAPACITY_DEFAULT_SLO, TuneSettings

    s = TuneSettings(model=Path("m"), shape=SHAPE, space=Path("s.yaml"), objective="capacity")
    assert s.measure.slo == CAPACITY_DEFAULT_SLO == {"ttft_p99": 2.0, "tpot_p99": 0.1}
    given = TuneSettings(model=Path("m"), shape=SHAPE, space=Path("s.yaml"),
                         objective="capacity", slo={"e2e_p99": 5.0})
    assert given.measure.slo == {"e2e_p99": 5.0}
    assert TuneSettings(model=Path("m"), shape=SHAPE, space=Path("s.yaml")).measure.slo == {}


def test_a_level_stopped_early_says_why_not_a_collapsed_goodput() -> None:
    # the H200's azure cross cell: a level stopped after 5 of 432 requests missed the SLOs
    # had finished only 27 % of them within the SLOs by then, which read as a collapse
    stopped = Level(scale=3.9, offered_rps=21.6, passed=False, goodput_fraction=0.273,
                    error_rate=0.0, offered=432, stopped_early=True,
                    note="5 of 432 requests missed the SLOs or failed (at most 4 may)")
    assert stopped.outcome() == ("fail, stopped early: 5 of 432 requests missed the SLOs or "
                                 "failed (at most 4 may)")
    assert "27" not in stopped.outcome()
    ran = Level(scale=2.0, offered_rps=11.1, passed=True, goodput_fraction=0.9934,
                error_rate=0.0, offered=222)
    assert ran.outcome() == "pass (99.3% within SLOs)"
    failed = Level(scale=4.0, offered_rps=22.1, passed=False, goodput_fraction=0.95,
                   error_rate=0.0, offered=442)
    assert failed.outcome() == "fail (95.0% within SLOs)"


def test_a_level_is_fitted_to_the_requests_it_serves() -> None:
    # pure: the request time from finished requests (median TTFT + the median output asked
    # for at the median time per token), then levels stretched to 3 of them, capped at 4x
    from autotune.load import RequestRecord
    from autotune.trial import LevelPlan, fit_level, request_seconds

    def rec(i: int, ttft: float, per_tok: float, n: int, ok: bool = True) -> RequestRecord:
        return RequestRecord(index=i, send_s=10.0, first_token_s=10.0 + ttft,
                             end_s=10.0 + ttft + per_tok * (n - 1), chunk_times_s=(),
                             chunk_tokens=(), prompt_tokens=100, output_tokens=n, ok=ok,
                             error=None, detail=None, status=200)

    # the warm-up finished its short requests (the long ones were cut off): their
    # per-token time still gives a 350-token request's duration, not theirs
    recs = [rec(i, 0.2, 0.04, 20 + i) for i in range(9)] + [rec(9, 9.0, 9.0, 50, ok=False)]
    req = request_seconds(recs, [350] * 30 + [100] * 10)
    assert req == pytest.approx(0.2 + 350 * 0.04)
    assert request_seconds(recs[:4], [350]) is None  # too few finished to say
    plan = LevelPlan(level_s=20.0)
    fitted, why = fit_level(plan, req)
    assert fitted.level_s == pytest.approx(3 * req, abs=0.05) and "not 20" in why
    assert fit_level(plan, 5.0) == (plan, "")  # 20 s outlast 3 requests of 5 s already
    assert fit_level(plan, None) == (plan, "")
    long, why = fit_level(plan, 60.0)
    assert long.level_s == 80.0 and "stretch cap" in why
    # 3 x 13.31 s = 39.93 s, printed 39.9: rounded, not capped (the H200 mooncake study said
    # "(the stretch cap)" here)
    mid, why = fit_level(plan, 13.31)
    assert mid.level_s == 39.9 and "stretch cap" not in why
    # 3 x 6.68 s = 20.04 s rounds to the 20 asked: no stretch to report (the H200 recipe's
    # mooncake cell said "levels of 20 s of arrivals, not 20")
    assert fit_level(plan, 6.68) == (plan, "")


def test_bench_says_when_it_stretched_the_levels(capsys: pytest.CaptureFixture[str]) -> None:
    # pure: what `autotune bench --capacity` prints from a trial whose levels were fitted
    from types import SimpleNamespace

    from autotune.cli._bench import _print_capacity
    from autotune.trial import LevelPlan, fit_level

    def printed(asked: float, req_s: float) -> str:
        plan, note = fit_level(LevelPlan(level_s=asked), req_s)
        out = SimpleNamespace(capacity={"level_s": plan.level_s, "level_s_asked": asked,
                                        "level_note": note, "levels": []},
                              metrics={}, warmup={"request_s": req_s}, message="none passed")
        assert _print_capacity(out, {}, 0.99) is False  # no level: no capacity
        return capsys.readouterr().out

    assert "levels of 36 s of arrivals, not 20" in printed(20.0, 12.0)
    assert "requests take ~12 s" in printed(20.0, 12.0)
    assert "(the stretch cap)" in printed(2.0, 4.96)
    assert "stretch cap" not in printed(20.0, 12.0)
    assert printed(20.0, 3.5) == ""  # not stretched: nothing to say


def test_a_level_says_which_slo_its_misses_exceeded() -> None:
    # pure: each request's misses by threshold, and the level's progress text with them
    from autotune.load import RequestRecord
    from autotune.measure import Slo, meets_slo, slo_misses
    from autotune.trial import Level

    def rec(ttft: float, tpot: float, ok: bool = True) -> RequestRecord:
        return RequestRecord(index=0, send_s=0.0, first_token_s=ttft,
                             end_s=ttft + 9 * tpot, chunk_times_s=(ttft, ttft + 9 * tpot),
                             chunk_tokens=(1, 9), prompt_tokens=10, output_tokens=10, ok=ok,
                             error=None, detail=None, status=200)

    slo = Slo(ttft_s=1.0, tpot_s=0.05)
    assert slo_misses(rec(0.5, 0.04), slo) == () and meets_slo(rec(0.5, 0.04), slo)
    assert slo_misses(rec(0.5, 0.06), slo) == ("tpot",)
    assert slo_misses(rec(2.0, 0.06), slo) == ("ttft", "tpot")
    assert slo_misses(rec(0.5, 0.04, ok=False), slo) == ("failed",)
    assert slo_misses(rec(2.0, 0.06), None) == ()
    lv = Level(scale=1.0, offered_rps=5.0, passed=False, goodput_fraction=0.2,
               error_rate=0.0, offered=100, stopped_early=True,
               note="2 of 100 requests missed the SLOs or failed (at most 1 may)",
               finished=20, missed_by={"tpot": 2})
    assert lv.outcome().endswith("(at most 1 may); over tpot 2")


def test_a_capacity_whose_misses_barely_grow_with_the_load_says_so() -> None:
    # pure: the H200's azure defaults (trial 0 of its study): TPOT p99 near its SLO
    # from 14 to 22 req/s, each failing level one miss over the bar (the `finished` counts
    # here are made up: they were not recorded then), so
    # the capacity lands by chance in that range (four starts read 9-14 req/s)
    from autotune.cli._tune import capacity_line
    from autotune.trial import CapacityResult, Level

    def lv(rps: float, offered: int, finished: int, missed: int) -> Level:
        return Level(scale=rps / 5.53, offered_rps=rps, passed=missed <= offered // 100,
                     goodput_fraction=(finished - missed) / offered, error_rate=0.0,
                     offered=offered, finished=finished, missed_by={"tpot": missed})

    levels = [lv(22.12, 443, 350, 5), lv(11.06, 222, 222, 0), lv(15.64, 313, 250, 4),
              lv(13.15, 264, 264, 1), lv(14.34, 287, 275, 3)]
    res = CapacityResult(recorded_rps=5.53, low=13.15 / 5.53, high=14.34 / 5.53,
                         status="levels", levels=levels)
    assert res.flat_misses(0.99) == (14.34, 22.12)
    assert res.to_dict(0.99)["flat_misses_rps"] == [14.34, 22.12]
    assert res.to_dict()["flat_misses_rps"] is None  # no goodput bar given: not judged
    # a sharp knee (no misses, then many) is not flat; nor are levels of few requests, or
    # ones recorded before `finished` was
    sharp = CapacityResult(recorded_rps=5.53, levels=[lv(11.06, 222, 222, 0),
                                                      lv(22.12, 443, 60, 5)])
    assert sharp.flat_misses(0.99) is None
    few = CapacityResult(recorded_rps=5.53, levels=[lv(14.0, 40, 40, 1), lv(22.0, 40, 40, 1)])
    assert few.flat_misses(0.99) is None and res.flat_misses(1.0) is None
    line = capacity_line({"capacity_rps": 13.15, "capacity_rps_ci_low": 13.15,
                          "capacity_rps_ci_high": 14.34, "recorded_rps": 5.53,
                          "goodput_bar": 0.99, "slo": {"tpot_p99": 0.05},
                          "flat_misses_rps": [14.34, 22.12]})
    assert "note: from 14.3 to 22.1 req/s every level missed" in line
    assert "note" not in capacity_line({"capacity_rps": 13.15, "recorded_rps": 5.53,
                                        "goodput_bar": 0.99, "slo": {}})
