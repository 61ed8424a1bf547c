"""An open-loop run's warm-up until steady state and its measurement sized by precision and
a time cap (autotune._open_loop; pure: records made by hand), and the capacity search's
time cap (autotune.capacity)."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.trial import STEADY_SPANS, OpenRun, cut_bounds
from autotune.trial import CapacitySearch, Level, search_capacity
from autotune.measure import SegmentRule


@dataclass
class Rec:
    index: int
    send_s: float
    end_s: float
    output_tokens: int = 100
    ok: bool = True

    @property
    def first_token_s(self) -> float:
        return self.send_s + 0.2


def _feed(run: OpenRun, recs: list[Rec]) -> str | None:
    for k, r in enumerate(recs, 1):
        why = run(r, k, 0)
        if why:
            return why
    return None


def _steady(n: int, gap: float = 0.5, dur: float = 4.0) -> list[Rec]:
    """n requests sent every ``gap`` s, each ``dur`` s long, in order of their ends."""
    return [Rec(i, i * gap, i * gap + dur) for i in range(n)]


def test_the_warm_up_waits_for_the_steady_state_not_two_agreeing_segments() -> None:
    recs = _steady(400)
    rule = SegmentRule(warmup_max_s=120.0)
    run = OpenRun(send_at=[r.send_s for r in recs], output=[100] * len(recs), rate_rps=2.0,
                  rule=rule, segment_s=2.0)
    assert _feed(run, recs) == "warm"
    # requests of ~4 s: warm after two of them (8 s), not after the first segment
    assert run.request_s is not None and 3.5 < run.request_s < 4.5
    assert run.warm_end is not None and run.warm_end >= STEADY_SPANS * run.request_s
    assert run.warm_end < 16.0 and run.converged
    rec = run.warmup_record()
    assert rec["rule"] == "steady_state" and rec["segments"] >= 2
    # Little's law: 2 req/s x ~4 s = ~8 in flight, as the run held
    assert 7.0 < rec["steady_in_flight"] < 9.0 and 6 <= rec["requests_in_flight"] <= 9
    assert run.cut is not None and run.cut <= run.warm_end  # the cancelled ones' first send


def test_a_warm_up_that_never_settles_ends_at_its_cap_not_converged() -> None:
    recs = _steady(400)
    calls = []

    def jit() -> bool:  # a kernel compiles in every segment: never steady
        calls.append(1)
        return True

    run = OpenRun(send_at=[r.send_s for r in recs], output=[100] * len(recs), rate_rps=2.0,
                  rule=SegmentRule(warmup_max_s=20.0), segment_s=2.0, jit=jit)
    assert _feed(run, recs) == "warm"
    assert run.warm_end is not None and 20.0 <= run.warm_end < 23.0
    assert not run.converged and run.jit_last and calls


def test_the_measurement_stops_when_precise_or_at_its_time_cap() -> None:
    recs = _steady(2000)
    sends = [r.send_s for r in recs]
    precise = OpenRun(send_at=sends, output=[100] * len(recs), rate_rps=2.0,
                      rule=SegmentRule(precision=0.1, min_segments=5, measure_max_s=300.0),
                      segment_s=5.0, measure=True)
    assert _feed(precise, recs) == "precise"  # a steady server: 5 segments suffice
    assert len(precise.rates) == 5 and len(precise.bounds) == 6
    bursty = [Rec(r.index, r.send_s, r.end_s, 40 + (r.index * 37) % 160) for r in recs]
    capped = OpenRun(send_at=sends, output=[100] * len(recs), rate_rps=2.0,
                     rule=SegmentRule(precision=0.001, measure_max_s=30.0), segment_s=5.0,
                     measure=True)
    assert _feed(capped, bursty) == "cap"
    assert capped.warm_end is not None and capped.stopped_at is not None
    assert 30.0 <= capped.stopped_at - capped.warm_end < 36.0
    # the window ends where the records stop holding every token: the first cancelled send
    assert capped.cut is not None and capped.cut <= capped.stopped_at
    kept = cut_bounds(capped.bounds, capped.cut)
    assert kept and all(b <= capped.cut for b in kept)


def test_cut_bounds() -> None:
    assert cut_bounds([10.0, 20.0, 30.0], None) == [10.0, 20.0, 30.0]
    assert cut_bounds([10.0, 20.0, 30.0], 25.0) == [10.0, 20.0]
    assert cut_bounds([10.0, 20.0], 15.0) == [10.0, 15.0]  # no whole segment: up to the cut


def _level(scale: float, passed: bool) -> Level:
    return Level(scale=scale, offered_rps=scale, passed=passed, goodput_fraction=1.0,
                 error_rate=0.0)


def test_the_capacity_search_stops_at_its_time_cap_with_the_bracket_so_far() -> None:
    probed: list[float] = []

    def probe(scale: float) -> Level:
        probed.append(scale)
        return _level(scale, scale <= 3.0)

    budget = [3]  # room for three levels

    def room(scale: float) -> bool:
        budget[0] -= 1
        return budget[0] > 0

    res = search_capacity(probe, recorded_rps=1.0, search=CapacitySearch(), room=room)
    assert res.status == "time" and len(probed) == 3  # 1, 2, 4 (the first needs no room)
    assert (res.low, res.high) == (2.0, 4.0)
    unlimited = search_capacity(probe, recorded_rps=1.0, search=CapacitySearch())
    assert unlimited.status == "found" and len(unlimited.levels) > 3


def test_an_idle_server_says_so() -> None:
    from autotune.trial import idle_note

    assert "idle: the server ran 3.2 requests" in idle_note(
        {"requests_running": 3.2, "requests_waiting_max": 0.0}, ())
    assert "batch limit 16" in idle_note({"requests_running": 1.0, "requests_waiting": 0.0},
                                         ("--max-num-seqs", "16"))
    assert idle_note({"requests_running": 3.2, "requests_waiting_max": 0.0},
                     ("--max-num-seqs=16",)) == ""  # 20 % of its limit: busy enough
    assert idle_note({"requests_running": 3.2, "requests_waiting_max": 2.0}, ()) == ""
    assert idle_note({}, ()) == ""  # no /metrics figures: nothing to say


def test_a_server_that_falls_behind_ends_the_warm_up_and_the_levels_start_lower() -> None:
    from autotune.trial import start_after_warmup

    # arrivals ask for 2 req/s x 100 tokens = 200 tok/s; the server finishes a request
    # every 2 s (50 tok/s): it falls behind, its queue only grows
    recs = [Rec(i, i * 0.5, 3.0 + 2.0 * i) for i in range(200)]
    run = OpenRun(send_at=[r.send_s for r in recs], output=[100] * len(recs), rate_rps=2.0,
                  rule=SegmentRule(warmup_max_s=120.0), segment_s=5.0)
    assert _feed(run, recs) == "warm"
    assert run.overloaded and not run.converged
    assert run.warm_end is not None and run.warm_end < 25.0  # not the 120-s cap
    warm = run.warmup_record()
    assert warm["overloaded"] and 0.2 <= warm["served_share"] <= 0.3
    search, why = start_after_warmup(CapacitySearch(), warm)
    assert search.start in (0.125, 0.25) and search.start <= warm["served_share"]
    assert "fell behind" in why and f"{search.start:.3g}x" in why
    # a warm-up that kept up changes nothing
    same = CapacitySearch()
    assert start_after_warmup(same, {"overloaded": False, "served_share": 0.2}) == (same, "")
    assert start_after_warmup(same, None) == (same, "")


def test_a_level_at_a_low_rate_fits_the_time_cap() -> None:
    from autotune.trial import LevelPlan

    assert LevelPlan(level_s=10.0).requests(0.0864) == 10  # no cap: at least 10 requests
    capped = LevelPlan(level_s=10.0, max_s=90.0)
    assert capped.requests(0.0864) == 4 and capped.seconds(0.0864) <= 45.0 + 1 / 0.0864
    assert capped.requests(5.0) == 50  # at a normal rate the cap changes nothing


def test_the_caps_hold_while_no_request_finishes() -> None:
    # a server far behind: one request finished in the first 5 s, none after; the
    # load generator's tick (once a second) ends the warm-up at its cap, then the
    # measurement at its own, although no completion closes a segment
    rule = SegmentRule(warmup_max_s=40.0, measure_max_s=30.0)
    run = OpenRun(send_at=[i * 0.2 for i in range(1000)], output=[100] * 1000, rate_rps=5.0,
                  rule=rule, segment_s=10.0, measure=True)
    assert run(Rec(0, 0.0, 5.0), 1, 0) is None
    ends = [(t, run.tick(float(t))) for t in range(6, 120)]
    warm = next(t for t, _ in ends if run.warm_end is not None and t >= run.warm_end)
    assert warm == 40 and run.warm_end == 40.0 and not run.converged
    assert run.warmup_record()["seconds"] == 40.0
    stop = next((t, why) for t, why in ends if why)
    assert stop == (70, "cap") and run.stopped_at == 70.0
    # before a cap a tick changes nothing: segments still end on completions
    idle = OpenRun(send_at=[0.0], output=[100], rate_rps=1.0, rule=rule, segment_s=10.0)
    assert [idle.tick(float(t)) for t in range(1, 40)] == [None] * 39
    assert idle.warm_rates == [] and idle.warm_end is None


def test_a_warm_up_that_fell_behind_is_the_brackets_top() -> None:
    # pure: the warm-up at 1x fell behind (its queue only grew), so 1x is not sustained:
    # the search runs downwards from 1/64 inside [?, 1x] and bisects, never above 1x
    from autotune.measure import Slo
    from autotune.trial import warmup_bound

    search = CapacitySearch(start=1.0 / 64)
    fell = {"overloaded": True, "served_share": 0.02, "jit_in_last_segment": False}
    slo = Slo(ttft_s=2.0, tpot_s=0.1)
    assert warmup_bound(CapacitySearch(), fell, slo) == 1.0
    assert warmup_bound(CapacitySearch(), {**fell, "jit_in_last_segment": True}, slo) is None
    assert warmup_bound(CapacitySearch(), {**fell, "overloaded": False}, slo) is None
    assert warmup_bound(CapacitySearch(), fell, None) is None  # no SLO a queue breaks
    assert warmup_bound(CapacitySearch(), fell, Slo(tpot_s=0.1)) is None
    assert warmup_bound(CapacitySearch(), None, slo) is None

    probed: list[float] = []

    def probe(scale: float) -> Level:
        probed.append(scale)
        return Level(scale=scale, offered_rps=scale * 5.53, passed=scale <= 0.2,
                     goodput_fraction=1.0 if scale <= 0.2 else 0.5, error_rate=0.0)

    res = search_capacity(probe, recorded_rps=5.53, search=search, failed_at=1.0)
    assert probed[:2] == [1.0 / 64, 0.125]  # bisects [1/64, 1]: no doubling up from 1/64
    assert max(probed) < 1.0 and res.status == "found"
    assert res.low is not None and res.high is not None and 0.125 <= res.low <= 0.2 < res.high
    assert not res.high_from_warmup  # a level failed below the warm-up's scale
    # one level fits the time cap: the bracket is [1/64, 1x], its top the warm-up's
    probed.clear()
    one = search_capacity(probe, recorded_rps=5.53, search=search, failed_at=1.0,
                          room=lambda scale: False)
    assert probed == [1.0 / 64] and one.status == "time"
    assert (one.low, one.high, one.high_from_warmup) == (1.0 / 64, 1.0, True)
    assert one.ci_high_rps == 5.53 and one.to_dict()["high_from_warmup"] is True
    assert "its top: the warm-up" in one.summary()
    # without it the same cap leaves a lower bound only
    probed.clear()
    alone = search_capacity(probe, recorded_rps=5.53, search=search, room=lambda scale: False)
    assert alone.high is None and alone.ci_high_rps is None
