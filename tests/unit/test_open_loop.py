"""An open-loop run's warm-up until steady state and its measurement sized by precision and
a time cap (autotune.trial._open_segments; pure: records made by hand), and the capacity search's
time cap (autotune.capacity)."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.trial import STEADY_SPANS, OpenRun, backlog_grows, cut_bounds
from autotune.trial import CapacitySearch, Level, search_capacity
import pytest

from autotune.measure import SegmentRule, Slo


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

    @property
    def chunk_times_s(self) -> list[float]:
        return [self.first_token_s, self.end_s]


def _feed(run: OpenRun, recs: list[Rec]) -> str | None:
    for k, r in enumerate(recs, 1):
        why = run(r, k, 0)
        if why:
            return why
    return None


def _feed_ticking(run: OpenRun, recs: list[Rec]) -> str | None:
    """As the load generator does: each completion in order of its end, and the clock's
    tick once a second in between (the backlog is sampled there)."""
    t = 1.0
    for k, r in enumerate(sorted(recs, key=lambda r: r.end_s), 1):
        while t <= r.end_s:
            if why := run.tick(t):
                return why
            t += 1.0
        if why := run(r, k, 0):
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
    assert "the time cap (--capacity-max-s 90) ended the search" in res.summary(
        CapacitySearch(), 90.0)
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
    # every 2 s (50 tok/s): it falls behind, its backlog grows 1.5 requests a second
    recs = [Rec(i, i * 0.5, 3.0 + 2.0 * i) for i in range(200)]
    run = OpenRun(send_at=[i * 0.5 for i in range(200)], output=[100] * 200, rate_rps=2.0,
                  rule=SegmentRule(warmup_max_s=120.0), segment_s=5.0)
    assert _feed_ticking(run, recs) == "warm"
    assert run.overloaded and not run.converged
    assert run.warm_end is not None and run.warm_end < 30.0  # not the 120-s cap
    warm = run.warmup_record()
    assert warm["overloaded"] and 0.2 <= warm["served_share"] <= 0.3
    search, why = start_after_warmup(CapacitySearch(), warm)
    # one tolerance step below the share served (the server's saturation)
    assert search.start == pytest.approx(warm["served_share"] / 1.25, rel=0.01)
    assert search.step == 1.25  # and steps by the tolerance from there
    assert "fell behind" in why and f"{search.start:.3g}x" in why
    # a warm-up that kept up changes nothing
    same = CapacitySearch()
    assert start_after_warmup(same, {"overloaded": False, "served_share": 0.2}) == (same, "")
    assert start_after_warmup(same, None) == (same, "")


def test_a_lull_in_the_arrivals_is_not_a_server_that_fell_behind() -> None:
    # recorded arrivals at a mean of 2 req/s come in a burst and a long lull: the server
    # serves every request in 1 s (nothing queues), so it served far less than the mean
    # rate asks for, and its backlog never grows: not overloaded, the warm-up converges
    sends = [i * 0.25 for i in range(40)] + [60.0 + i * 2.0 for i in range(60)]
    recs = [Rec(i, t, t + 1.0) for i, t in enumerate(sends)]
    slo = Slo(ttft_s=2.0, tpot_s=0.1)
    run = OpenRun(send_at=sends, output=[100] * len(sends), rate_rps=2.0,
                  rule=SegmentRule(warmup_max_s=120.0), segment_s=5.0, slo=slo)
    assert _feed_ticking(run, recs) == "warm"
    assert not run.overloaded and run.converged


def test_a_burst_the_server_absorbs_is_not_a_trend() -> None:
    # the backlog rises for 10 s (a burst) and drains: the first half of the window grows,
    # the second shrinks
    burst = [(float(t), min(t, 20 - t) * 2) for t in range(0, 21)]
    assert not backlog_grows(burst, 20.0)
    growing = [(float(t), 3 + t) for t in range(0, 21)]
    assert backlog_grows(growing, 20.0)
    assert not backlog_grows(growing[:5], 4.0)  # too few samples to call a trend
    flat = [(float(t), 10 + (t % 2)) for t in range(0, 21)]
    assert not backlog_grows(flat, 20.0)


def test_a_server_far_within_its_slos_is_never_overloaded() -> None:
    # the backlog grows (a batch that fills up: 0.8 more in flight each second), but every
    # request meets the SLOs with room (TTFT 0.2 s of 2 s, TPOT under 10 ms of 100 ms)
    sends = [i * 0.25 for i in range(400)]
    recs = [Rec(i, t, t + 1.0 + t / 4, output_tokens=1000) for i, t in enumerate(sends)]
    slo = Slo(ttft_s=2.0, tpot_s=0.1)

    def judged(slo: Slo | None) -> OpenRun:
        run = OpenRun(send_at=sends, output=[1000] * len(sends), rate_rps=4.0,
                      rule=SegmentRule(warmup_max_s=60.0), segment_s=100.0, slo=slo)
        _feed_ticking(run, [r for r in recs if r.end_s <= 30.0])
        return run

    run = judged(slo)
    assert backlog_grows(run.backlog, 30.0)
    assert run.comfortable(30.0) and not run._overloaded(30.0)
    # the same run judged without an SLO: its growing backlog calls it overloaded
    assert judged(None)._overloaded(30.0)
    # a request waiting in flight past half what the SLOs allow it spoils the comfort
    assert not run.comfortable(200.0)


def test_a_level_at_a_low_rate_fits_the_time_cap() -> None:
    from autotune.trial import LevelPlan

    assert LevelPlan(level_s=10.0).requests(0.0864) == 40  # no cap: at least 40 requests
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
    # steps up from 1/64 (doubling), never past the middle of [pass, 1x]
    assert probed[:3] == pytest.approx([1.0 / 64, 2.0 / 64, 4.0 / 64])
    assert all(b <= (a * 1.0) ** 0.5 + 1e-12 for a, b in zip(probed, probed[1:]) if b > a)
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
