"""Intervals of a rate that mean what they say (autotune.intervals; pure)."""

from __future__ import annotations

import math

import pytest

from autotune.measure import arrivals_note, fmt_interval, rate_interval
from autotune.measure import mean_interval


def test_symmetric_segments_keep_the_t_interval() -> None:
    segs = [100.0, 104.0, 98.0, 101.0, 97.0, 103.0]
    lo, hi, how = rate_interval(100.5, segs)
    iv = mean_interval(segs)
    assert how == "t" and iv is not None
    assert lo == pytest.approx(100.5 - (iv.high - iv.low) / 2)
    assert hi == pytest.approx(100.5 + (iv.high - iv.low) / 2)


def test_a_bursty_open_loop_never_reads_below_zero() -> None:
    # five sub-windows of a bursty open loop: one caught a burst (the normal approximation
    # gave [-7.0, 114.5] out tok/s on such a trace)
    segs = [12.0, 9.0, 180.0, 14.0, 54.0]
    rate = sum(segs) / len(segs)
    iv = mean_interval(segs)
    assert iv is not None and rate - (iv.high - iv.low) / 2 < 0  # what the t-interval says
    lo, hi, how = rate_interval(rate, segs)
    assert how == "log-t" and lo is not None and hi is not None
    assert 0 < lo < rate < hi and math.isclose(lo * hi, rate * rate)  # a factor around it


def test_a_segment_that_served_nothing_gets_a_bootstrap_interval() -> None:
    segs = [0.0, 0.0, 150.0, 10.0, 5.0]
    lo, hi, how = rate_interval(33.0, segs)
    assert how == "bootstrap" and lo is not None and hi is not None
    assert 0.0 <= lo < 33.0 < hi
    assert rate_interval(33.0, segs) == (lo, hi, how)  # seeded: the same every time


@pytest.mark.parametrize("rate, segs", [(None, [1.0, 2.0]), (5.0, [1.0]), (5.0, []),
                                        (float("nan"), [1.0, 2.0]),
                                        (5.0, [float("nan"), 1.0])])
def test_no_interval_without_a_rate_or_two_segments(rate: float | None,
                                                    segs: list[float]) -> None:
    assert rate_interval(rate, segs) == (None, None, None)


def test_all_zero_segments_give_a_zero_interval() -> None:
    lo, hi, _ = rate_interval(0.0, [0.0, 0.0, 0.0])
    assert lo == 0.0 and hi == 0.0


def test_the_arrivals_note_says_when_the_spread_is_the_traffic() -> None:
    offered = [40.0, 30.0, 400.0, 50.0, 120.0]  # tokens/s the arrivals asked for
    served = [42.0, 28.0, 390.0, 55.0, 118.0]  # an idle server serves what arrives
    note = arrivals_note(served, offered)
    assert "comes from the arrivals" in note and "correlation" in note
    # a steady offer with a server that wobbles: the spread is the server's
    assert arrivals_note([90.0, 130.0, 70.0, 120.0, 95.0],
                         [100.0, 101.0, 99.0, 100.0, 100.0]) == ""
    assert arrivals_note([1.0, 2.0], [1.0, 2.0]) == ""  # too few segments


def test_intervals_print_unambiguously() -> None:
    assert fmt_interval(-7.0, 114.5) == "[-7.00, 114]"
    assert fmt_interval(1234.5, 2000.0) == "[1,234, 2,000]"
    assert fmt_interval(1.0, 2.0, ".3f") == "[1.000, 2.000]"
    assert fmt_interval(None, 2.0) == ""
    # both ends by one rule: a slow server's capacity is not 0.1, its top not 5.5
    assert fmt_interval(0.0864, 5.53) == "[0.0864, 5.53]"


def test_every_rate_prints_by_one_rule() -> None:
    """Three significant digits and every digit left of the point, thousands separated:
    the rule of the summary, ``autotune best``, the progress and the report."""
    from autotune.measure import fmt_bracket, fmt_value

    cases = {0.0864: "0.0864", 0.321: "0.321", 2.567: "2.57", 17.64: "17.6", 176.4: "176",
             7611.1: "7,611", 12345.6: "12,346", 0.0: "0", 1.0: "1.00", 5.53042: "5.53",
             # rounding that adds a digit takes the next decade's decimals
             9.996: "10.0", 99.96: "100", 0.09996: "0.100"}
    for v, want in cases.items():
        assert fmt_value(v) == want, (v, fmt_value(v))
    assert "e" not in fmt_value(1.234e-6) and fmt_value(1.234e-6) == "0.00000123"
    assert fmt_value(math.inf) == "inf"
    # a bracket reads the same wherever it prints, an end no level gave in words
    assert fmt_bracket(0.321, 2.567) == "[0.321, 2.57] req/s"
    assert fmt_bracket(14.34, None) == fmt_bracket(14.34, math.inf) == "[14.3, none failed] req/s"
    assert fmt_bracket(None, 0.0864) == "[none passed, 0.0864] req/s"


def test_an_idle_server_under_bursty_arrivals_measures_the_traffic() -> None:
    # measure() of an open loop whose arrivals come in bursts: the server serves each
    # request as it arrives (10 tokens over 0.1 s), so the sub-windows follow the bursts
    from autotune.load import RunResult
    from autotune.measure import measure
    from tests.unit.test_measure import rec

    sends = [0.0, 0.1, 0.2, 5.0, 20.0, 20.05, 20.1, 20.15, 20.2, 20.25, 20.3, 20.35, 33.0,
             47.0, 47.1, 49.9]
    recs = tuple(rec(i, t, out=10) for i, t in enumerate(sends))
    run = RunResult(records=recs, started_at=0.0, wall_s=50.2, mode="open", concurrency=None)
    m = measure(run, warmup_s=0.0)
    assert m.output_tokens_per_s is not None and m.output_tokens_per_s > 0
    assert m.output_tokens_per_s_ci_low is not None and m.output_tokens_per_s_ci_low >= 0
    assert m.ci_method in ("log-t", "bootstrap")
    assert "comes from the arrivals" in m.interval_note


def test_an_interval_holds_the_repeats_spread_and_a_drift_it_measured() -> None:
    # issue 66: bench --repeats 3 printed 1,212.5 with [1,157, 1,269] from the segments,
    # "CV 17.1 % across repeats; second half -23.0 % over the first", repeats 1,212.5 /
    # 1,325.0 / 940.1 on one server
    from autotune.measure._intervals import held_interval

    repeats = [1212.5, 1325.0, 940.1]
    lo, hi, method = held_interval(1212.5, 1157.0, 1269.0, "t", repeats=repeats)
    assert lo is not None and hi is not None and method is not None
    assert lo < 940.1 and hi > 1325.0  # the repeats' t-interval (2 df) reaches past both
    assert "widened to the spread of 3 repeats" in method
    # a drift the warm-up did not cover: the interval reaches both halves' means
    segments = [1300.0, 1310.0, 1290.0, 1305.0, 1000.0, 1010.0, 990.0, 1005.0]
    lo, hi, method = held_interval(1151.25, 1140.0, 1160.0, "t", segments=segments)
    assert lo == pytest.approx(1001.25) and hi == pytest.approx(1301.25)
    assert method is not None and "drift of -23.1% between the halves" in method
    # steady segments and agreeing repeats leave it as it was
    steady = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 1002.0]
    assert held_interval(1000.0, 990.0, 1010.0, "t", segments=steady,
                         repeats=[1000.0, 1001.0, 999.0]) == (990.0, 1010.0, "t")
