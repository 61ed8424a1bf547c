"""Records -> Measurement: window, throughput, percentiles, goodput, CV, server figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError

from autotune.errors import LoadgenError
from autotune.load import RequestRecord, RunResult
from autotune.measure import (
    Measurement,
    MeasurementRecord,
    Percentiles,
    PercentilesRecord,
    ServerSnapshot,
    Slo,
    combine,
    measure,
    parse_metrics,
    server_figures,
)

NAN = float("nan")


def rec(
    index: int,
    send: float,
    *,
    ttft: float = 0.1,
    out: int = 10,
    gap: float = 0.01,
    per_chunk: int = 1,
    ok: bool = True,
    error: str | None = None,
) -> RequestRecord:
    n_chunks = math.ceil(out / per_chunk)
    times = tuple(send + ttft + k * gap for k in range(n_chunks))
    toks = tuple(min(per_chunk, out - k * per_chunk) for k in range(n_chunks))
    return RequestRecord(
        index=index,
        send_s=send,
        first_token_s=times[0] if times else None,
        end_s=(times[-1] if times else send) + 0.001,
        chunk_times_s=times,
        chunk_tokens=toks,
        prompt_tokens=5,
        output_tokens=out,
        ok=ok,
        error=error,
        detail=None if ok else "boom",
        status=200 if ok else 500,
    )


def closed_run(
    streams: int = 4, per_stream: int = 10, *, ttft: float = 0.1, out: int = 10, gap: float = 0.01
) -> RunResult:
    """Each stream sends its next request the moment the previous one ends."""
    records = []
    i = 0
    for s in range(streams):
        t = 0.0
        for _ in range(per_stream):
            r = rec(i, t + s * 1e-4, ttft=ttft, out=out, gap=gap)
            records.append(r)
            t = r.end_s  # type: ignore[assignment]
            i += 1
    records.sort(key=lambda r: r.send_s)
    wall = max(r.end_s for r in records)  # type: ignore[type-var]
    return RunResult(
        records=tuple(records), started_at=1000.0, wall_s=wall, mode="closed", concurrency=streams
    )


def test_closed_loop_throughput_over_the_steady_window() -> None:
    run = closed_run(streams=4, per_stream=10, ttft=0.1, out=10, gap=0.01)
    m = measure(run)
    # one request = 0.1 s to first token + 9 gaps of 0.01 + 1 ms: 10 tokens per 0.191 s per stream
    per_stream_rate = 10 / 0.191
    assert m.window_rule == "steady"
    assert m.output_tokens_per_s == pytest.approx(4 * per_stream_rate, rel=0.08)
    assert m.requests_per_s == pytest.approx(4 / 0.191, rel=0.08)
    assert m.goodput_rps == m.requests_per_s  # no SLO: every ok request counts
    # the window ends when the first stream runs dry (its last request ended)
    last_send = max(r.send_s for r in run.records)
    first_dry = min(r.end_s for r in run.records if r.end_s >= last_send)  # type: ignore[operator]
    assert m.window_end_s == pytest.approx(first_dry, abs=1e-3)
    assert m.window_start_s == pytest.approx(0.1 * m.window_end_s, rel=0.05)
    assert m.ttft_s.p50 == pytest.approx(0.1) and m.tpot_s.p50 == pytest.approx(0.01)
    assert m.itl_s.p99 == pytest.approx(0.01) and m.e2e_s.mean == pytest.approx(0.191)
    assert m.n_errors == 0 and m.error_rate == 0.0 and m.errors == {}
    assert m.cv is not None and m.cv_kind == "subwindows" and m.cv < 0.5
    assert m.total_output_tokens == 400


def test_warmup_seconds_override_the_fraction() -> None:
    run = closed_run()
    m = measure(run, warmup_s=0.5)
    assert m.window_start_s == pytest.approx(0.5)
    with pytest.raises(LoadgenError, match="warmup_fraction"):
        measure(run, warmup_fraction=1.5)


def test_tokens_are_counted_by_chunk_time_inside_the_window() -> None:
    # two streams, one request each: 3-token chunks every 0.1 s from t=0.1 to 1.0
    recs = (
        rec(0, 0.0, ttft=0.1, out=30, gap=0.1, per_chunk=3),
        rec(1, 0.0, ttft=0.1, out=30, gap=0.1, per_chunk=3),
    )
    run = RunResult(records=recs, started_at=0.0, wall_s=1.1, mode="closed", concurrency=2)
    m = measure(run, warmup_s=0.3)
    # window [0.3, first end 1.001): chunks at 0.3..1.0 = 8 per request, 3 tokens each
    assert m.window_s == pytest.approx(0.701, abs=1e-6)
    assert m.output_tokens_per_s == pytest.approx(2 * 8 * 3 / 0.701)
    assert m.tpot_s.p50 == pytest.approx(0.9 / 29)  # per token, not per chunk
    assert m.itl_s.p50 == pytest.approx(0.1)  # per chunk, as vLLM's bench reports ITL


def test_open_loop_window_ends_with_the_last_arrival() -> None:
    recs = tuple(rec(i, 0.1 * i) for i in range(20))
    run = RunResult(records=recs, started_at=0.0, wall_s=2.2, mode="open", concurrency=None)
    m = measure(run)
    assert m.window_end_s == pytest.approx(1.9)
    assert m.window_start_s == pytest.approx(0.19)
    # 10 tokens per 0.1 s arrival: 100 tokens/s, 10 requests/s
    assert m.output_tokens_per_s == pytest.approx(100, rel=0.1)
    assert m.requests_per_s == pytest.approx(10, rel=0.1)


def test_goodput_counts_requests_that_met_every_slo() -> None:
    recs = [rec(i, 0.0, ttft=0.05 if i % 2 else 0.5) for i in range(8)]
    run = RunResult(records=tuple(recs), started_at=0.0, wall_s=1.0, mode="closed", concurrency=8)
    m = measure(run, slo=Slo(ttft_s=0.1))
    assert m.window_rule == "steady" and m.n_latency == 8  # burst: all sent before the window
    assert m.goodput_rps == pytest.approx(m.requests_per_s / 2)  # type: ignore[operator]
    assert measure(run, slo=Slo(ttft_s=1.0, tpot_s=0.02, e2e_s=1.0)).goodput_rps == m.requests_per_s
    assert measure(run, slo=Slo(e2e_s=0.2)).goodput_rps == pytest.approx(m.requests_per_s / 2)  # type: ignore[operator]


def test_failures_are_counted_and_their_tokens_are_not_throughput() -> None:
    good = [rec(i, 0.0) for i in range(4)]
    bad = [
        rec(4, 0.0, ok=False, error="disconnected"),
        rec(5, 0.0, ok=False, error="http_5xx", out=0),
    ]
    run = RunResult(
        records=tuple(good + bad), started_at=0.0, wall_s=1.0, mode="closed", concurrency=6
    )
    m = measure(run)
    assert (m.n_requests, m.n_ok, m.n_errors) == (6, 4, 2)
    assert m.errors == {"disconnected": 1, "http_5xx": 1}
    assert m.error_rate == pytest.approx(2 / 6)
    alone = measure(
        RunResult(records=tuple(good), started_at=0.0, wall_s=1.0, mode="closed", concurrency=4)
    )
    assert m.output_tokens_per_s == pytest.approx(alone.output_tokens_per_s)


def test_empty_run_measures_nothing_without_raising() -> None:
    m = measure(RunResult(records=(), started_at=0.0, wall_s=0.0))
    assert m.n_requests == 0 and m.error_rate is None
    assert m.output_tokens_per_s is None and m.requests_per_s is None and m.goodput_rps is None
    assert m.window_rule == "none" and m.ttft_s == Percentiles()
    assert m.flat() == {"n_requests": 0.0, "n_errors": 0.0}


def test_all_failed_run_says_so() -> None:
    recs = tuple(
        RequestRecord(
            i,
            0.01 * i,
            None,
            0.02 * i,
            (),
            (),
            None,
            0,
            False,
            "connection_refused",
            "refused",
            None,
        )
        for i in range(5)
    )
    m = measure(RunResult(records=recs, started_at=0.0, wall_s=0.1, mode="closed", concurrency=2))
    assert m.error_rate == 1.0 and m.errors == {"connection_refused": 5}
    assert m.output_tokens_per_s is None and m.window_s is None and m.cv is None
    flat = m.flat()
    assert flat["error_rate"] == 1.0 and "output_tokens_per_s" not in flat


def test_nan_and_inf_in_records_are_ignored() -> None:
    weird = RequestRecord(
        9,
        NAN,
        NAN,
        float("inf"),
        (NAN, 0.5, float("inf")),
        (1, 1, 1),
        None,
        3,
        True,
        None,
        None,
        200,
    )
    run = closed_run()
    run2 = RunResult(
        records=run.records + (weird,),
        started_at=0.0,
        wall_s=run.wall_s,
        mode="closed",
        concurrency=4,
    )
    m = measure(run2)
    assert m.output_tokens_per_s is not None and math.isfinite(m.output_tokens_per_s)
    assert all(math.isfinite(v) for v in m.flat().values())


def test_burst_shorter_than_warmup_falls_back_to_the_whole_run() -> None:
    # one request: nothing is in flight after the window's start would be set
    run = RunResult(
        records=(rec(0, 0.0, ttft=0.2, out=3, gap=0.1),),
        started_at=0.0,
        wall_s=0.5,
        mode="closed",
        concurrency=1,
    )
    m = measure(run, warmup_s=5.0)
    assert m.window_rule == "whole_run"
    assert m.output_tokens_per_s == pytest.approx(3 / 0.201, rel=0.01)


FLAT_KEYS = {
    "output_tokens_per_s",
    "requests_per_s",
    "goodput_rps",
    "error_rate",
    "n_requests",
    "n_errors",
    *(f"{n}_{p}_s" for n in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p90", "p99")),
    "cv",
    "window_s",
    "output_tokens_per_s_ci_low",
    "output_tokens_per_s_ci_high",
    "segments",
}


def test_flat_has_exactly_the_agreed_keys() -> None:
    run = closed_run()
    snaps = (snap(0.0, gen=0), snap(10.0, gen=500))
    m = measure(run, server_before=snaps[0], server_after=snaps[1])
    flat = m.flat()
    assert {k for k in flat if not k.startswith("server_")} == FLAT_KEYS
    assert flat["server_generation_tokens"] == 500 and flat["server_generation_tokens_per_s"] == 50
    assert all(isinstance(v, float) and math.isfinite(v) for v in flat.values())


def test_measurement_record_is_the_stored_json_with_the_models_keys() -> None:
    # outcome.measurement is stored and read back (bench's JSON, the fault suite): its typed
    # record names exactly the model's fields, and it is the model's own JSON dump
    m = combine([measure(closed_run(gap=g)) for g in (0.01, 0.02)])
    r = m.record()
    assert set(MeasurementRecord.__annotations__) == set(Measurement.model_fields) == set(r)
    assert set(PercentilesRecord.__annotations__) == set(Percentiles.model_fields)
    assert set(r["ttft_s"]) == set(Percentiles.model_fields)
    assert r == m.model_dump(mode="json") and isinstance(r["repeat_tokens_per_s"], list)
    assert Measurement.model_validate(r) == m


def test_combine_takes_medians_and_the_cv_across_repeats() -> None:
    ms = [measure(closed_run(gap=g)) for g in (0.01, 0.012, 0.02)]
    errs = Measurement.model_validate(
        {**ms[0].model_dump(), "errors": {"timeout": 2}, "n_errors": 2, "n_requests": 42}
    )
    c = combine([ms[1], errs, ms[2]])
    tps = sorted(m.output_tokens_per_s for m in (ms[1], errs, ms[2]))  # type: ignore[type-var]
    assert c.output_tokens_per_s == pytest.approx(tps[1])
    assert c.repeats == 3 and c.cv_kind == "repeats" and len(c.repeat_tokens_per_s) == 3
    mean = sum(tps) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in tps) / 2)
    assert c.cv == pytest.approx(sd / mean)
    assert c.errors == {"timeout": 2} and c.n_requests == 40 + 42 + 40 and c.n_errors == 2
    assert c.ttft_s.p50 == pytest.approx(0.1)
    assert c.window_s == pytest.approx(sum(m.window_s for m in (ms[1], errs, ms[2])))  # type: ignore[misc]
    assert combine([ms[0]]) is ms[0]
    # each repeat keeps its own server figures; the combined ``server`` is their median
    steps = [Measurement.model_validate({**m.model_dump(), "server": {"step_ms": v}})
             for m, v in zip(ms, (30.0, 40.0, 33.0), strict=True)]
    c = combine(steps)
    assert [r["step_ms"] for r in c.repeat_server] == [30.0, 40.0, 33.0]
    assert c.server["step_ms"] == 33.0
    assert [r["step_ms"] for r in combine([c, steps[0]]).repeat_server] == [30.0, 40.0, 33.0, 30.0]
    # and how many of the pooled segments each repeat measured, in order
    segs = [Measurement.model_validate({**m.model_dump(), "segment_tokens_per_s": (1.0,) * k,
                                        "repeat_segments": (k,)})
            for m, k in zip(ms, (3, 5, 4), strict=True)]
    c = combine(segs)
    assert c.repeat_segments == (3, 5, 4) and len(c.segment_tokens_per_s) == 12
    assert combine([c, segs[0]]).repeat_segments == (3, 5, 4, 3)
    one = measure(closed_run(gap=0.01))
    assert one.repeat_segments == (len(one.segment_tokens_per_s),)
    with pytest.raises(LoadgenError, match="at least one"):
        combine([])


def test_slo_thresholds_must_be_positive_seconds() -> None:
    for bad in (0.0, -1.0, NAN, float("inf")):
        with pytest.raises(ValidationError):
            Slo(ttft_s=bad)
    with pytest.raises(ValidationError):
        Slo(ttft_p99=1.0)  # type: ignore[call-arg]


# --- server snapshots --------------------------------------------------------------------


def snap(t: float, *, gen: float, **counters: float) -> ServerSnapshot:
    c = {"vllm:generation_tokens": gen, **{f"vllm:{k}": v for k, v in counters.items()}}
    return ServerSnapshot(taken_at=t, counters=c)


def test_parse_metrics_sums_label_sets_with_prometheus_client() -> None:
    reg = CollectorRegistry()
    gen = Counter("vllm:generation_tokens", "", ["engine"], registry=reg)
    gen.labels("0").inc(100)
    gen.labels("1").inc(50)
    ttft = Histogram("vllm:time_to_first_token_seconds", "", ["engine"], registry=reg)
    ttft.labels("0").observe(0.2)
    ttft.labels("1").observe(0.4)
    kv = Gauge("vllm:kv_cache_usage_perc", "", ["engine"], registry=reg)
    kv.labels("0").set(0.2)
    kv.labels("1").set(0.6)
    Gauge("vllm:num_requests_running", "", ["engine"], registry=reg).labels("0").set(3)
    Counter("process_other", "", registry=reg).inc()
    s = parse_metrics(generate_latest(reg).decode(), taken_at=5.0)
    assert s.counters == {"vllm:generation_tokens": 150.0}
    assert s.histograms["vllm:time_to_first_token_seconds"] == pytest.approx((0.6, 2.0))
    assert s.gauges["vllm:kv_cache_usage_perc"] == pytest.approx(0.4)  # *_perc: mean
    assert s.gauges["vllm:num_requests_running"] == 3.0
    with pytest.raises(LoadgenError, match="not Prometheus text"):
        parse_metrics("vllm:x{ 1 2 3", taken_at=0.0)


def test_server_figures_from_counter_and_histogram_deltas() -> None:
    before = ServerSnapshot(
        taken_at=0.0,
        counters={"vllm:generation_tokens": 1000, "vllm:num_preemptions": 1},
        histograms={"vllm:time_to_first_token_seconds": (10.0, 100.0)},
    )
    after = ServerSnapshot(
        taken_at=4.0,
        counters={
            "vllm:generation_tokens": 1800,
            "vllm:num_preemptions": 3,
            "vllm:spec_decode_num_drafts": 100,
            "vllm:spec_decode_num_draft_tokens": 300,
            "vllm:spec_decode_num_accepted_tokens": 210,
            "vllm:prefix_cache_queries": 1000,
            "vllm:prefix_cache_hits": 250,
        },
        gauges={"vllm:kv_cache_usage_perc": 0.5},
        histograms={"vllm:time_to_first_token_seconds": (14.0, 110.0)},
    )
    f = server_figures(before, after)
    assert f["generation_tokens"] == 800 and f["generation_tokens_per_s"] == 200
    assert f["preemptions"] == 2
    assert f["spec_acceptance_rate"] == pytest.approx(0.7)
    assert f["spec_acceptance_length"] == pytest.approx(3.1)
    assert f["prefix_cache_hit_rate"] == 0.25
    assert f["ttft_mean_s"] == pytest.approx(0.4)
    assert f["kv_cache_usage"] == 0.5
    # a restart between the snapshots (counters went down) gives no figure rather than a wrong one
    assert "generation_tokens" not in server_figures(after, before)
    assert "step_ms" not in f  # no engine-step histogram, no step figures


def test_engine_step_figures_from_the_iteration_tokens_histogram() -> None:
    """vLLM observes each engine step's computed tokens once: steps, their rate, their wall
    time and how full they were (e.g. an MTP step's tokens per stream) come from it."""
    reg = CollectorRegistry()
    hist = Histogram("vllm:iteration_tokens_total", "", ["engine"], registry=reg,
                     buckets=(1, 8, 64, 512, 8192))
    gen = Counter("vllm:generation_tokens", "", ["engine"], registry=reg)
    hist.labels("0").observe(32)
    before = parse_metrics(generate_latest(reg).decode(), taken_at=10.0)
    for _ in range(400):  # 400 decode steps of 32 streams x 1.75 tokens
        hist.labels("0").observe(56)
    gen.labels("0").inc(400 * 56)
    after = parse_metrics(generate_latest(reg).decode(), taken_at=12.0)
    f = server_figures(before, after)
    assert f["engine_steps"] == 400
    assert f["engine_steps_per_s"] == pytest.approx(200.0)
    assert f["step_ms"] == pytest.approx(5.0)
    assert f["tokens_per_step"] == pytest.approx(56.0)
    assert f["generated_tokens_per_step"] == pytest.approx(56.0)


def test_measure_reads_server_figures_from_samples_around_the_window() -> None:
    run = closed_run()  # window about [0.19, 1.91] s from the start at t=1000
    samples = tuple(
        ServerSnapshot(
            taken_at=1000.0 + t,
            counters={"vllm:generation_tokens": 100.0 * t},
            gauges={"vllm:kv_cache_usage_perc": t},
        )
        for t in (0.0, 0.1, 0.5, 1.0, 1.95, 2.1)
    )
    run2 = RunResult(
        records=run.records,
        started_at=1000.0,
        wall_s=run.wall_s,
        mode="closed",
        concurrency=4,
        snapshots=samples,
    )
    m = measure(run2)
    assert m.server["interval_s"] == pytest.approx(1.85)  # 0.1 -> 1.95 brackets the window
    assert m.server["generation_tokens_per_s"] == pytest.approx(100.0)
    assert m.server["kv_cache_usage"] == pytest.approx(0.75)  # mean of samples inside (0.5, 1.0)
    assert m.server["kv_cache_usage_max"] == pytest.approx(1.0)


def test_segments_set_the_window_and_the_interval() -> None:
    run = closed_run(streams=4, per_stream=20)  # 4 streams x 10 tokens every ~0.2 s
    bounds = [0.5, 1.0, 1.5, 2.0, 2.5]
    m = measure(run, segments=bounds)
    assert (m.window_start_s, m.window_end_s) == (0.5, 2.5)
    assert m.segment_kind == "segments" and len(m.segment_tokens_per_s) == 4
    lo, hi = m.output_tokens_per_s_ci_low, m.output_tokens_per_s_ci_high
    assert lo is not None and hi is not None and m.output_tokens_per_s is not None
    assert lo <= m.output_tokens_per_s <= hi
    # half-width from the t-interval of the segment rates, around the window's rate
    seg = np.asarray(m.segment_tokens_per_s)
    half = 3.1824 * seg.std(ddof=1) / 2
    assert (hi - lo) / 2 == pytest.approx(half, rel=1e-3)
    flat = m.flat()
    assert flat["segments"] == 4 and flat["output_tokens_per_s_ci_low"] == lo
    seg4 = m.segment_tokens_per_s
    assert flat["output_tokens_per_s_drift"] == pytest.approx(
        (seg4[2] + seg4[3]) / (seg4[0] + seg4[1]) - 1)
    # without segments the interval comes from the sub-windows
    plain = measure(run)
    assert plain.segment_kind == "subwindows" and len(plain.segment_tokens_per_s) == 5
    assert plain.output_tokens_per_s_ci_low is not None
    # combining repeats pools their segments
    c = combine([m, m])
    assert len(c.segment_tokens_per_s) == 8 and c.output_tokens_per_s_ci_low is not None
