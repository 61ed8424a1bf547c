"""Pure statistics: intervals, the segment rule (warm-up, adaptive stop, pruner), the verdict."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from autotune.measure import (
    Interval,
    SegmentRule,
    decide_verdict,
    drift,
    mean_interval,
    ratio_to_defaults,
    relative_half_width,
)
from tests.conftest import REPO


def test_mean_interval_is_the_student_t_interval() -> None:
    iv = mean_interval([10.0, 12.0, 11.0, 13.0])
    assert iv is not None and iv.value == pytest.approx(11.5)
    # t(0.975, 3) = 3.182; s = 1.291; half = 3.182 * 1.291 / 2
    assert iv.high - iv.value == pytest.approx(3.1824 * 1.2910 / 2, rel=1e-3)
    assert iv.value - iv.low == pytest.approx(iv.high - iv.value)


def test_mean_interval_needs_two_finite_values() -> None:
    assert mean_interval([]) is None
    assert mean_interval([5.0]) is None
    assert mean_interval([5.0, math.nan, math.inf]) is None
    iv = mean_interval([5.0, math.nan, 7.0])
    assert iv is not None and iv.value == 6.0
    assert relative_half_width(None) == math.inf
    assert relative_half_width(Interval(0.0, -1.0, 1.0)) == math.inf


def test_mean_interval_covers_the_true_mean_about_95_percent() -> None:
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(2000):
        iv = mean_interval(list(rng.normal(100.0, 5.0, size=5)))
        assert iv is not None
        hits += iv.low <= 100.0 <= iv.high
    assert 0.93 < hits / 2000 < 0.97


# --- warm-up ------------------------------------------------------------------------------


def test_warmup_converges_when_two_segments_agree_and_no_jit() -> None:
    rule = SegmentRule(warmup_tolerance=0.05)
    assert rule.warmup([500.0], False, 5) == "continue"  # one segment is never enough
    assert rule.warmup([500.0, 900.0], False, 10) == "continue"  # still ramping
    assert rule.warmup([500.0, 900.0, 1000.0], False, 15) == "continue"  # 10 % apart
    assert rule.warmup([500.0, 900.0, 1000.0, 1020.0], False, 20) == "warm"
    assert rule.warmup_converged([900.0, 1000.0, 1020.0], False)


def test_warmup_goes_on_past_two_agreeing_segments_at_the_tail_of_a_steep_ramp() -> None:
    # the H200's 256-stream warm-up that stopped mid-ramp (then measured 6,711 / 7,079 /
    # 7,521): the last two agree (5.0 %), the last three climbed 23 %
    rule = SegmentRule(warmup_tolerance=0.05)
    h200 = [4776.7, 5888.7, 6195.8]
    assert rule.agree(h200[-2], h200[-1]) and rule.ramping(h200)
    assert rule.warmup(h200, False, 30) == "continue"
    assert not rule.warmup_converged(h200, False)
    # one more segment that agrees and ends the climb: warm
    assert rule.warmup([*h200, 6250.0], False, 40) == "warm"
    # ... one that keeps climbing 5-6 % a segment never agrees: the cap ends it, not converged
    climbing = [*h200, 6711.0, 7079.0, 7521.0]
    assert all(rule.warmup(climbing[:i], False, 10.0 * i) == "continue" for i in range(1, 7))
    assert not rule.warmup_converged(climbing, False)
    # a fall is a ramp too; noise that goes up and down is not; nor a climb within 3 x 5 %
    assert rule.ramping([8000.0, 6600.0, 6300.0])
    assert not rule.ramping([6000.0, 6400.0, 6200.0])
    assert not rule.ramping([900.0, 1000.0, 1020.0])  # 11.8 % over three: converged
    assert not rule.ramping([1000.0, 1001.0]) and not rule.ramping([math.nan, 1.0, 2.0])


def test_warmup_goes_on_while_kernels_compile_even_if_segments_agree() -> None:
    rule = SegmentRule(warmup_tolerance=0.05)
    assert rule.warmup([1000.0, 1001.0], True, 10) == "continue"
    assert not rule.warmup_converged([1000.0, 1001.0], True)
    assert rule.warmup([1000.0, 1001.0, 1002.0], False, 15) == "warm"


def test_warmup_is_capped_and_then_not_converged() -> None:
    rule = SegmentRule(warmup_max_segments=4, warmup_max_s=60)
    rates = [100.0, 200.0, 400.0, 800.0]
    assert rule.warmup(rates, False, 30) == "warm"  # 4 segments: the cap
    assert not rule.warmup_converged(rates, False)
    assert rule.warmup([100.0, 300.0], True, 61) == "warm"  # time cap
    assert not SegmentRule().agree(0.0, 0.0) and not SegmentRule().agree(math.nan, 1.0)


# --- adaptive stop and pruner -----------------------------------------------------------


def test_measurement_stops_when_the_interval_is_within_the_precision() -> None:
    # a few agreeing segments do not stop a run by default (the H200's drifting runs)
    assert SegmentRule().measure([1000.0, 1001.0, 999.0, 1000.0], 40) == "continue"
    rule = SegmentRule(precision=0.02, min_segments=3)
    assert rule.measure([1000.0, 1000.0], 10) == "continue"  # fewer than min_segments
    steady = [1000.0, 1004.0, 998.0, 1002.0]
    assert rule.measure(steady, 20) == "stop_precise"
    noisy = [1000.0, 1100.0, 900.0, 1050.0]
    assert rule.measure(noisy, 20) == "continue"
    assert relative_half_width(mean_interval(noisy)) > 0.02


def test_measurement_stops_at_its_caps() -> None:
    rule = SegmentRule(precision=0.001, measure_max_segments=6, measure_max_s=100)
    noisy = [1000.0, 1100.0, 900.0, 1050.0, 950.0]
    assert rule.measure(noisy, 50) == "continue"
    assert rule.measure([*noisy, 1000.0], 50) == "stop_cap"
    assert rule.measure(noisy, 100) == "stop_cap"


def test_more_noise_needs_more_segments() -> None:
    rng = np.random.default_rng(7)
    rule = SegmentRule(precision=0.02, measure_max_segments=500, measure_max_s=1e9)

    def segments_needed(cv: float) -> int:
        rates: list[float] = []
        while True:
            rates.append(float(rng.normal(1000.0, 1000.0 * cv)))
            if rule.measure(rates, 0) != "continue":
                return len(rates)

    quiet = np.median([segments_needed(0.01) for _ in range(30)])
    loud = np.median([segments_needed(0.05) for _ in range(30)])
    assert quiet == rule.min_segments < loud  # quiet runs stop at the minimum


def test_pruner_stops_a_clear_loser_only() -> None:
    rule = SegmentRule(precision=0.001, prune_after=2)
    loser = [700.0, 705.0]
    assert rule.measure(loser, 10, incumbent_low=1000.0) == "stop_pruned"
    assert rule.measure(loser[:1], 5, incumbent_low=1000.0) == "continue"  # too early
    # an interval that reaches the incumbent's low end is not a clear loser
    close = [950.0, 1040.0]
    assert (mean_interval(close) or Interval(0, 0, 0)).high >= 1000.0
    assert rule.measure(close, 10, incumbent_low=1000.0) == "continue"
    assert rule.measure(loser, 10, incumbent_low=None) == "continue"  # pruner off


# --- the verdict -------------------------------------------------------------------------


def test_ratio_pools_the_between_start_variance_on_the_log_scale() -> None:
    r = ratio_to_defaults([1100.0, 1110.0], [1000.0, 1005.0], others=[[900.0, 905.0]])
    assert r is not None
    assert r.median == pytest.approx(math.sqrt(1100 * 1110) / math.sqrt(1000 * 1005), rel=1e-9)
    assert r.ci_low < r.median < r.ci_high
    assert "df=3" in r.method and r.n_config == 2 and r.n_defaults == 2
    # the log interval is symmetric: median^2 = low * high
    assert r.median ** 2 == pytest.approx(r.ci_low * r.ci_high, rel=1e-9)


def test_a_real_winner_is_declared() -> None:
    # 10 % better, starts repeat within about 1 %
    r = ratio_to_defaults([1100.0, 1108.0], [1000.0, 995.0], others=[[950.0, 960.0]])
    v = decide_verdict(r)
    assert v.verdict == "winner" and r is not None and r.ci_low > 1.0


def test_a_gap_inside_the_noise_leaves_the_defaults_best() -> None:
    # the earlier study's trap: one lucky reading 8 % up, starts 17 % apart
    r = ratio_to_defaults([1080.0, 990.0], [1000.0, 860.0])
    v = decide_verdict(r)
    assert v.verdict == "defaults_best" and r is not None
    assert r.ci_low < 1.0 < r.ci_high and r.median > 1.0
    assert "defaults remain best" in v.reason


def test_verdict_edge_cases() -> None:
    assert decide_verdict(None).verdict == "defaults_best"
    assert decide_verdict(None, candidate_is_defaults=True).verdict == "defaults_best"
    assert ratio_to_defaults([], [1000.0]) is None
    assert ratio_to_defaults([1000.0], [0.0, math.nan]) is None
    # one reading each: only the within-run intervals can say anything
    assert ratio_to_defaults([1100.0], [1000.0]) is None
    r = ratio_to_defaults([1100.0], [1000.0], within={
        "config": Interval(1100.0, 1090.0, 1110.0), "defaults": Interval(1000.0, 990.0, 1010.0)})
    assert r is not None and "within-run" in r.method and r.ci_low > 1.0


def test_one_fresh_start_each_takes_the_spread_from_every_start() -> None:
    from autotune.measure import starts_needed

    # the H200's azure capacity study (experiments/h200-shapes): the recipe
    # read 15.64 req/s in the search, 18.60 on its fresh re-check start; the defaults 13.15
    # and 12.06. Its capacity brackets as within-run intervals claimed [1.447, 1.644].
    within = {"config": Interval(18.60, 18.60, 20.28), "defaults": Interval(12.06, 12.06, 13.15)}
    narrow = ratio_to_defaults([18.60], [12.06], within=within)
    assert narrow is not None and narrow.ci_low > 1.4
    # the estimate stays on the fresh readings, the spread comes from both starts of each
    r = ratio_to_defaults([18.60], [12.06], within=within,
                          spread=[[15.64, 18.60], [13.15, 12.06]])
    assert r is not None and r.median == pytest.approx(narrow.median)
    assert r.df == 2 and "search readings included" in r.method
    assert r.ci_low < 1.0 < r.median and r.ci_high > 2.5
    # log SD sqrt(((ln 18.60/15.64)^2 + (ln 13.15/12.06)^2) / 4)
    assert r.log_sd == pytest.approx(0.0967, abs=1e-3)
    assert starts_needed(r) == 2
    # spread groups with one reading each measure nothing: back to within-run intervals
    lone = ratio_to_defaults([18.60], [12.06], within=within, spread=[[18.60], [12.06]])
    assert lone is not None and "within-run" in lone.method


def test_starts_needed_is_the_least_count_whose_interval_would_clear_1() -> None:
    from autotune.measure import ratio_to_defaults, starts_needed

    # the H200 at 256 streams (experiments/h200-trust): two starts each,
    # 1.094x with [0.847, 1.412]; the pooled start-to-start SD of log readings is 5.9 %
    r = ratio_to_defaults([13955.46, 14530.92], [13768.53, 12314.16])
    assert r is not None and r.ci_low < 1 < r.median
    assert r.df == 2 and r.log_sd == pytest.approx(0.0594, abs=1e-3)
    n = starts_needed(r)
    assert n == 5
    # check it against the interval itself: n starts each at exactly that mean and spread
    # (readings exp(mu +- log_sd * k), k making the sample SD log_sd) clear 1, n - 1 do not
    def readings(level: float, m: int) -> list[float]:
        z = np.linspace(-1.0, 1.0, m)
        z = z / z.std(ddof=1)
        return [float(level * math.exp(r.log_sd * x)) for x in z]

    def lower(m: int) -> float:
        got = ratio_to_defaults(readings(r.median, m), readings(1.0, m))
        assert got is not None and got.median == pytest.approx(r.median)
        return got.ci_low

    assert lower(n) > 1.0 > lower(n - 1)


def test_starts_needed_is_none_when_no_number_of_starts_would_show_a_gain() -> None:
    from autotune.measure import Interval, ratio_to_defaults, starts_needed

    slower = ratio_to_defaults([950.0, 980.0], [1000.0, 1010.0])
    assert slower is not None and slower.median < 1 and starts_needed(slower) is None
    # within-run intervals only: no start-to-start spread was measured to plan with
    within = ratio_to_defaults([1100.0], [1000.0], within={
        "config": Interval(1100.0, 900.0, 1300.0), "defaults": Interval(1000.0, 990.0, 1010.0)})
    assert within is not None and within.log_sd is None and starts_needed(within) is None
    # a 0.1 % gain under a 10 % start-to-start spread: beyond any sensible count
    tiny = ratio_to_defaults([1001.0, 1101.0], [1000.0, 1100.0])
    assert tiny is not None and starts_needed(tiny) is None
    assert starts_needed(None) is None


def test_drift_compares_the_halves_of_a_measurement() -> None:
    # the H200's fresh-machine defaults at 256 streams (experiments/h200-shapes): still
    # speeding up through the measurement
    rising = [6752.9, 6773.0, 7176.1, 7500.0, 7909.1, 7736.5, 8289.7]
    d = drift(rising)
    assert d is not None and d.significant
    # the middle segment of an odd count is left out: (7736.5 + 8289.7 + 7909.1) / 3 over
    # (6752.9 + 6773.0 + 7176.1) / 3
    assert d.relative == pytest.approx((7909.1 + 7736.5 + 8289.7) / (6752.9 + 6773.0 + 7176.1) - 1)
    # a steady server's noise: halves that differ within it are not a drift
    steady = [7730.4, 7876.4, 7179.1, 7611.3, 8034.9, 7764.5, 7499.6, 7773.7]
    d = drift(steady)
    assert d is not None and not d.significant and abs(d.relative) < 0.03
    # falling counts too; too few segments say nothing
    d = drift(list(reversed(rising)))
    assert d is not None and d.significant and d.relative < 0
    assert drift([1.0, 2.0, 3.0]) is None
    assert drift([5.0, 5.0, 5.0, 5.0]) == drift([5.0, 5.0, math.nan, 5.0, 5.0])


def test_min_segments_reaches_the_rule_of_tune_and_bench(tmp_path: Path) -> None:
    """`--min-segments` is the stop's minimum in `autotune bench` and in a study's trials;
    out of range it is one clear error before any server starts."""
    import json

    from autotune.cli._bench import bench_spec, parse_bench
    from autotune.config import TuneSettings
    from autotune.errors import ConfigError

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 64}))
    shape = REPO / "traffic" / "example-chat.json"
    base = ["--model", str(model), "--shape", str(shape)]
    assert bench_spec(parse_bench(base)).rule.min_segments == 5
    spec = bench_spec(parse_bench([*base, "--min-segments", "8"]))
    assert spec.rule.min_segments == 8
    with pytest.raises(ConfigError, match="--min-segments 1: .*greater than or equal to 2"):
        bench_spec(parse_bench([*base, "--min-segments", "1"]))
    settings = TuneSettings(model=model, shape=shape, space=shape, min_segments=7)
    assert settings.measure.min_segments == 7
    with pytest.raises(ValueError, match="min_segments"):
        TuneSettings(model=model, shape=shape, space=shape, min_segments=1)


def test_output_jitter_reaches_the_trials_of_tune_and_bench(tmp_path: Path) -> None:
    """`--output-jitter` (default 0.1; bench's 0 with --no-stagger) is what each trial's
    closed-loop schedule is built with; out of range it is one clear error up front."""
    import json

    from autotune.cli._bench import bench_spec, parse_bench
    from autotune.config import TuneSettings
    from autotune.errors import ConfigError
    from autotune.space import LaunchSpec
    from autotune.study import TrialTemplate
    from autotune.traffic import load_shape

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 64}))
    shape = REPO / "traffic" / "casestudy-512x512.json"
    base = ["--model", str(model), "--shape", str(shape)]
    assert bench_spec(parse_bench(base)).measure.output_jitter == 0.1
    assert bench_spec(parse_bench([*base, "--no-stagger"])).measure.output_jitter == 0.0
    assert bench_spec(parse_bench([*base, "--no-stagger", "--output-jitter", "0.2"])
                      ).measure.output_jitter == 0.2
    with pytest.raises(ConfigError, match=r"--output-jitter 1.0: .*less than 1"):
        bench_spec(parse_bench([*base, "--output-jitter", "1"]))
    template = TrialTemplate(model=str(model), shape=load_shape(shape))
    for given, want in (({}, 0.1), ({"output_jitter": 0.0}, 0.0), ({"output_jitter": 0.3}, 0.3)):
        settings = TuneSettings(model=model, shape=shape, space=shape, **given)
        spec = template.spec(0, LaunchSpec(), settings, probe=False)
        assert spec.measure.output_jitter == want
    with pytest.raises(ValueError, match="output_jitter"):
        TuneSettings(model=model, shape=shape, space=shape, output_jitter=1.0)


def test_an_open_capacity_bracket_gives_no_point_ratio() -> None:
    """One start each and a capacity search that ended before a failing level: the
    capacity is only a lower bound, so no ratio (and no winner) comes from it."""
    from autotune.measure import Interval, decide_verdict, ratio_to_defaults

    open_c = Interval(0.173, 0.173, math.inf)
    open_d = Interval(0.086, 0.086, math.inf)
    closed = Interval(0.086, 0.07, 0.1)
    for c, d in ((open_c, open_d), (open_c, closed), (Interval(0.173, 0.15, 0.2), open_d)):
        r = ratio_to_defaults([c.value], [d.value], within={"config": c, "defaults": d})
        assert r is None
        assert decide_verdict(r).verdict == "defaults_best"
    # a closed bracket on both sides still gives its within-run ratio
    r = ratio_to_defaults([0.173], [0.086], within={"config": Interval(0.173, 0.15, 0.2),
                                                    "defaults": closed})
    assert r is not None and r.ci_low < r.median < r.ci_high
