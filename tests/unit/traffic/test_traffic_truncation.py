"""Where a recording stops must not flip a drift verdict (issue 19, item 4).

Each public trace is cut by 0.1-1 % of its requests and by a few seconds, and compared with
the whole: ``shape diff`` says "same" and the burstiness statistic moves little. Before the
fix the last, partial 60-s window counted as a full one (a dip, or a burst of the last few
requests in a couple of seconds) and moved ``dispersion_60s`` by up to 10x.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from autotune.traffic import TraceRecords, build_schedule, diff_shapes, fit_shape, read_trace
from autotune.traffic._shape import full_window_counts


def _head(records: TraceRecords, n: int) -> TraceRecords:
    prefix = None if records.prefix is None else records.prefix.take(np.arange(n))
    return dataclasses.replace(
        records,
        timestamps_s=records.timestamps_s[:n],
        input_tokens=records.input_tokens[:n],
        output_tokens=records.output_tokens[:n],
        latencies_s=None if records.latencies_s is None else records.latencies_s[:n],
        prefix=prefix,
        sessions=None if records.sessions is None else records.sessions.take(np.arange(n)),
    )


def _cuts(records: TraceRecords) -> list[tuple[str, int]]:
    n = len(records)
    ts = records.timestamps_s
    out = [(f"-{f:.1%} requests", n - max(1, round(n * f))) for f in (0.001, 0.003, 0.01)]
    for sec in (2.0, 5.0, 20.0):
        out.append((f"-{sec:g} s", int(np.searchsorted(ts, ts[-1] - sec, side="right"))))
    return out


@pytest.mark.parametrize("trace", ["azure_path", "mooncake_path", "burstgpt_path"])
def test_truncating_a_recording_keeps_the_verdict(trace: str, request: pytest.FixtureRequest
                                                  ) -> None:
    records = read_trace(request.getfixturevalue(trace))
    whole = fit_shape(records)
    assert whole.arrivals is not None and whole.arrivals.dispersion_60s is not None
    for label, n in _cuts(records):
        cut = fit_shape(_head(records, n))
        d = diff_shapes(whole, cut)
        assert d.verdict == "same", (label, d.drifted_dimensions)
        b = d.dimensions["burstiness"]
        # the statistic moves little: well under a fifth of the 2x threshold
        assert b.distance is not None and b.distance < 0.2, (label, b)
        # and the replay's burstiness (derived from it) with it
        assert cut.arrivals is not None
        ra, rb = whole.arrivals.dispersion_60s, cut.arrivals.dispersion_60s
        assert rb is not None and abs(math.sqrt(rb) / math.sqrt(ra) - 1) < 0.1, label
        # the profile ends with a full window, not with the few requests of a partial one
        prof = cut.arrivals.rate_profile
        if float(np.mean(prof)) * cut.arrivals.window_s > 20:  # not BurstGPT's 54 rows
            assert min(prof[-1], prof[-2]) > 0.3 * float(np.mean(prof)), label


def test_extending_by_a_few_seconds_keeps_the_verdict(azure_path: object) -> None:
    """Seen from the shorter recording: the whole one is the shorter one plus a few s."""
    records = read_trace(azure_path)  # type: ignore[arg-type]
    ts = records.timestamps_s
    for extra in (1.0, 3.0, 10.0):
        n = int(np.searchsorted(ts, ts[-1] - extra, side="right"))
        short = fit_shape(_head(records, n))
        assert diff_shapes(short, fit_shape(records)).verdict == "same"


def test_full_window_counts_leave_out_the_partial_window() -> None:
    ts = np.array([0.0, 10.0, 59.9, 60.0, 61.0, 119.0, 120.0, 121.0])
    assert full_window_counts(ts, 60.0).tolist() == [3, 3]  # 120 and 121 are in a partial one
    assert full_window_counts(ts[:3], 60.0).tolist() == []  # shorter than one window
    assert full_window_counts(np.array([]), 60.0).tolist() == []


def test_poisson_with_a_burst_of_stragglers_stays_poisson() -> None:
    """The issue's case: Poisson arrivals, then 11 requests in the last 2 s."""
    rng = np.random.default_rng(0)
    ts = np.cumsum(rng.exponential(1 / 3.4, size=12_000))
    ts = ts[ts < 3540.0]
    tail = ts[-1] + np.sort(rng.uniform(0, 2.0, size=11))
    n = ts.shape[0] + 11
    rec = TraceRecords(
        path="poisson", format="synthetic", timestamps_s=np.concatenate((ts, tail)) - ts[0],
        input_tokens=np.full(n, 100, dtype=np.int64), output_tokens=np.full(n, 10, dtype=np.int64),
    )
    shape = fit_shape(rec)
    assert shape.arrivals is not None and shape.arrivals.dispersion_60s is not None
    assert 0.6 < shape.arrivals.dispersion_60s < 1.6
    assert diff_shapes(shape, fit_shape(_head(rec, n - 11))).verdict == "same"
    # the gamma replay's CV comes from the same statistic: near 1, not sqrt(13)
    sched = build_schedule(shape.with_load(shape.load.model_copy(update={"requests": 2000})),
                           vocab_size=512, arrival="gamma")
    gaps = np.diff([r.send_at_s for r in sched.requests if r.send_at_s is not None])
    assert 0.8 < gaps.std() / gaps.mean() < 1.25
