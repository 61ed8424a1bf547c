"""Request records -> a Measurement: steady-state throughput, latency percentiles, goodput,
noise, and the server's own figures from ``/metrics``.

Everything here is pure: the ``/metrics`` client is :mod:`autotune.load` (its
names are re-exported here). ``docs/measurement.md`` explains the steady-state window, the
percentiles, goodput, the CV and the server figures.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from autotune.errors import LoadgenError
from autotune.load import (
    ServerSnapshot,
)
from autotune.measure._intervals import arrivals_note, held_interval, rate_interval

if TYPE_CHECKING:
    from autotune.load import RequestRecord, RunResult
from autotune.measure._model import Measurement, Percentiles, Slo
from autotune.measure._server import SUBWINDOWS, WARMUP_FRACTION, server_figures
from autotune.measure._sessions import session_figures


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _window(
    run: RunResult, warmup_s: float | None, warmup_fraction: float
) -> tuple[float, float] | None:
    """The steady-state window [t0, t1) in seconds from the run's start, or None.

    t1: closed loop, the first successful end at or after the last send (the first stream
    that runs dry); open loop, the last send (arrivals stop). t0: the time the in-flight count first
    reaches the target concurrency (closed) or the first send (open), then ``warmup_s``
    from the start if given, else ``warmup_fraction`` of the span up to t1.
    """
    recs = run.records
    sends = [r.send_s for r in recs if _finite(r.send_s)]
    ends = [r.end_s for r in recs if r.end_s is not None and _finite(r.end_s)]
    if not sends or not ends:
        return None
    last_send = max(sends)
    first_send = min(sends)
    if run.mode == "open" and last_send > first_send:
        t_full, t1 = first_send, last_send
    else:
        target = min(run.concurrency or len(sends), len(sends))
        events = sorted([(s, 1) for s in sends] + [(e, -1) for e in ends])  # ends first on ties
        t_full, live = first_send, 0
        for t, step in events:
            live += step
            if live >= target:
                t_full = t
                break
        # A request that failed fast must not end the window: use successful ends if any.
        ok_ends = [r.end_s for r in recs if r.ok and r.end_s is not None and _finite(r.end_s)]
        later = [e for e in (ok_ends or ends) if e >= last_send]
        t1 = min(later) if later else max(ends)
    if warmup_s is not None and _finite(warmup_s):
        t0 = max(t_full, warmup_s)
    else:
        t0 = t_full + warmup_fraction * max(0.0, t1 - t_full)
    return (t0, t1) if t1 > t0 else None


def _latencies(
    r: RequestRecord,
) -> tuple[float | None, float | None, float | None, list[float]]:
    """(ttft, tpot, e2e, inter-chunk gaps) of one record; None where undefined."""
    send, first, end = r.send_s, r.first_token_s, r.end_s
    ok_send = send is not None and math.isfinite(send)
    ttft = first - send if ok_send and first is not None and math.isfinite(first) else None
    e2e = end - send if ok_send and end is not None and math.isfinite(end) else None
    times = [t for t in r.chunk_times_s if math.isfinite(t)]
    tpot = None
    if r.output_tokens > 1 and times and first is not None and times[-1] >= first:
        tpot = (times[-1] - first) / (r.output_tokens - 1)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return ttft, tpot, e2e, gaps


def slo_misses(r: RequestRecord, slo: Slo | None) -> tuple[str, ...]:
    """Why a request does not count toward goodput: ("failed",), or the SLO thresholds it
    exceeded (``Slo.missed_by``); () when it counts."""
    if not r.ok:
        return ("failed",)
    if slo is None:
        return ()
    ttft, tpot, e2e, _ = _latencies(r)
    return slo.missed_by(ttft, tpot, e2e)


def slo_excess(r: RequestRecord, slo: Slo | None) -> tuple[str, float, float] | None:
    """How far a request missed: the threshold it exceeded most (relative to the limit)
    as (name, its figure in seconds, the limit); None when it met every threshold or
    failed (a failure has no figure)."""
    if slo is None or not r.ok:
        return None
    ttft, tpot, e2e, _ = _latencies(r)
    worst: tuple[str, float, float] | None = None
    for name, lim, v in (("ttft", slo.ttft_s, ttft), ("tpot", slo.tpot_s, tpot),
                         ("e2e", slo.e2e_s, e2e)):
        if lim is not None and v is not None and v > lim and (
                worst is None or v / lim > worst[1] / worst[2]):
            worst = (name, v, lim)
    return worst


def meets_slo(r: RequestRecord, slo: Slo | None) -> bool:
    """A request counts toward goodput: it succeeded and met every threshold of ``slo``."""
    if not r.ok:
        return False
    if slo is None:
        return True
    ttft, tpot, e2e, _ = _latencies(r)
    return slo.met_by(ttft, tpot, e2e)


def _token_arrays(records: Sequence[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    times: list[float] = []
    toks: list[int] = []
    for r in records:
        if len(r.chunk_times_s) == len(r.chunk_tokens):
            times.extend(r.chunk_times_s)
            toks.extend(r.chunk_tokens)
    t = np.asarray(times, dtype=float)
    k = np.asarray(toks, dtype=float)
    keep = np.isfinite(t) & np.isfinite(k) & (k > 0)
    return t[keep], k[keep]


def _cv(values: Sequence[float]) -> float | None:
    arr = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    if arr.size < 2 or arr.mean() <= 0:
        return None
    return float(arr.std(ddof=1) / arr.mean())


def _pick_snapshots(
    run: RunResult, window: tuple[float, float] | None
) -> tuple[ServerSnapshot, ServerSnapshot, list[ServerSnapshot]] | None:
    snaps = sorted(run.snapshots, key=lambda s: s.taken_at)
    if len(snaps) < 2:
        return None
    if window is None:
        return snaps[0], snaps[-1], snaps
    t0, t1 = window
    at = [s.taken_at - run.started_at for s in snaps]
    before = max((i for i, a in enumerate(at) if a <= t0), default=0)
    after = min((i for i, a in enumerate(at) if a >= t1), default=len(snaps) - 1)
    if after <= before:
        return None
    inside = [s for s, a in zip(snaps, at, strict=True) if t0 <= a <= t1]
    return snaps[before], snaps[after], inside


def _token_rate(times: np.ndarray, toks: np.ndarray, window: tuple[float, float] | None,
                rule: str, bounds: Sequence[float], subwindows: int
                ) -> tuple[float | None, list[float]]:
    """(token rate over the window, segment rates): the segments are ``bounds`` when given
    (a segmented run), else ``subwindows`` equal sub-windows."""
    if window is None:
        return None, []
    t0, t1 = window
    inside = (times >= t0) & (times < t1) if rule == "steady" else (times >= t0) & (times <= t1)
    tok_rate = float(toks[inside].sum() / (t1 - t0))
    edges = np.asarray(bounds if bounds else np.linspace(t0, t1, max(1, subwindows) + 1),
                       dtype=float)
    if edges.size < 3:
        return tok_rate, []
    sums, _ = np.histogram(times[inside], bins=edges, weights=toks[inside])
    seg_rates = [float(x) for x in sums / np.diff(edges)]
    return tok_rate, seg_rates


def _offered_rates(ok: Sequence[RequestRecord], window: tuple[float, float],
                   bounds: Sequence[float], subwindows: int) -> list[float]:
    """Output tokens of the requests sent in each segment (``bounds``, else ``subwindows``
    equal sub-windows of ``window``), per second: what an open loop's arrivals offered
    (autotune.measure.arrivals_note)."""
    edges = np.asarray(bounds if bounds else np.linspace(window[0], window[1],
                                                         max(1, subwindows) + 1), dtype=float)
    sends = np.asarray([r.send_s for r in ok], dtype=float)
    outs = np.asarray([r.output_tokens for r in ok], dtype=float)
    sums, _ = np.histogram(sends, bins=edges, weights=outs)
    return [float(x) for x in sums / np.diff(edges)]


def measure(
    run: RunResult,
    *,
    slo: Slo | None = None,
    warmup_s: float | None = None,
    server_before: ServerSnapshot | None = None,
    server_after: ServerSnapshot | None = None,
    warmup_fraction: float = WARMUP_FRACTION,
    subwindows: int = SUBWINDOWS,
    segments: Sequence[float] | None = None,
) -> Measurement:
    """Measure one run over its steady-state window (see ``docs/measurement.md``).

    Throughput counts the tokens of successful requests by chunk arrival time inside the
    window; requests/s is that token rate over the mean output length; goodput scales it
    by the share of requests that met ``slo``. Latency percentiles are over the successful
    requests sent inside the window (all successful ones when none was). Server figures
    come from ``server_before``/``server_after`` when given, else from the run's
    ``/metrics`` samples that bracket the window.
    """
    if not 0.0 <= warmup_fraction < 1.0:
        raise LoadgenError(f"warmup_fraction is {warmup_fraction}; it must be in [0, 1)")
    recs = run.records
    n = len(recs)
    failed = [r for r in recs if not r.ok]
    errors = dict(Counter(r.error or "unknown" for r in failed))
    ok = [r for r in recs if r.ok and _finite(r.send_s)]
    total_tokens = int(sum(r.output_tokens for r in recs if r.output_tokens > 0))

    bounds = sorted(b for b in (segments or ()) if _finite(b))
    window = (bounds[0], bounds[-1]) if len(bounds) >= 2 and bounds[-1] > bounds[0] else None
    if window is None:
        bounds = []
        window = _window(run, warmup_s, warmup_fraction)
    rule: Literal["steady", "whole_run", "none"] = "steady"
    times, toks = _token_arrays(ok)
    if window is not None and not np.any((times >= window[0]) & (times < window[1])):
        window = None
    if window is None and times.size:
        lo, hi = float(times.min()), float(times.max())
        ends = [r.end_s for r in ok if r.end_s is not None and _finite(r.end_s)]
        hi = max([hi, *ends])
        if hi > lo:
            window, rule = (lo, hi), "whole_run"
    if window is None:
        rule = "none"

    tok_rate, seg_rates = _token_rate(
        times, toks, window, rule, bounds if rule == "steady" else [], subwindows)
    ci_lo, ci_hi, ci_method = rate_interval(tok_rate, seg_rates)
    if bounds and rule == "steady":  # segments in time order: a drift widens the interval
        ci_lo, ci_hi, ci_method = held_interval(tok_rate, ci_lo, ci_hi, ci_method,
                                                segments=seg_rates)
    cv = _cv(seg_rates) if seg_rates else None

    lat_set = ok
    if window is not None and rule == "steady":
        started = [r for r in ok if window[0] <= r.send_s < window[1]]
        lat_set = started or ok
    ttfts, tpots, e2es, itls, met = _latency_lists(lat_set, slo)

    rps: float | None = None
    goodput: float | None = None
    mean_out = float(np.mean([r.output_tokens for r in lat_set])) if lat_set else 0.0
    if tok_rate is not None and mean_out > 0:
        rps = tok_rate / mean_out
        goodput = rps * met / len(lat_set)

    server: dict[str, float] = {}
    if server_before is not None and server_after is not None:
        server = server_figures(server_before, server_after)
    else:
        picked = _pick_snapshots(run, window)
        if picked is not None:
            server = server_figures(*picked)

    return Measurement(
        output_tokens_per_s=tok_rate,
        requests_per_s=rps,
        goodput_rps=goodput,
        error_rate=len(failed) / n if n else None,
        n_requests=n,
        n_ok=n - len(failed),
        n_errors=len(failed),
        errors=errors,
        window_s=(window[1] - window[0]) if window is not None else None,
        window_start_s=window[0] if window is not None else None,
        window_end_s=window[1] if window is not None else None,
        window_rule=rule,
        n_latency=len(lat_set),
        ttft_s=Percentiles.of(ttfts),
        tpot_s=Percentiles.of(tpots),
        itl_s=Percentiles.of(itls),
        e2e_s=Percentiles.of(e2es),
        cv=cv,
        cv_kind="subwindows" if cv is not None else None,
        repeats=1,
        repeat_tokens_per_s=(tok_rate,) if tok_rate is not None else (),
        total_output_tokens=total_tokens,
        server=server,
        output_tokens_per_s_ci_low=ci_lo,
        output_tokens_per_s_ci_high=ci_hi,
        ci_method=ci_method,
        interval_note=(arrivals_note(seg_rates, _offered_rates(ok, window, bounds, subwindows))
                       if run.mode == "open" and seg_rates and window and rule == "steady"
                       else ""),
        segment_tokens_per_s=tuple(seg_rates),
        segment_kind=("segments" if bounds and rule == "steady" else "subwindows")
        if seg_rates else None,
        repeat_segments=(len(seg_rates),),
        sessions=session_figures(recs, run.wall_s),
    )


def _latency_lists(lat_set: Sequence[RequestRecord], slo: Slo | None
                   ) -> tuple[list[float], list[float], list[float], list[float], int]:
    """TTFTs, TPOTs, E2Es, ITLs of the latency set and how many met every SLO threshold."""
    ttfts: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    itls: list[float] = []
    met = 0
    for r in lat_set:
        ttft, tpot, e2e, gaps = _latencies(r)
        if ttft is not None:
            ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
        if e2e is not None:
            e2es.append(e2e)
        itls.extend(gaps)
        if slo is None or slo.met_by(ttft, tpot, e2e):
            met += 1
    return ttfts, tpots, e2es, itls, met


def _median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(vals)) if vals else None


def combine(measurements: Sequence[Measurement]) -> Measurement:
    """Combine repeats: median throughputs and percentiles, CV across repeats, pooled errors."""
    ms = list(measurements)
    if not ms:
        raise LoadgenError("combine() needs at least one measurement; got none")
    if len(ms) == 1:
        return ms[0]
    per_repeat = [v for m in ms for v in (m.repeat_tokens_per_s or ())]
    errors: Counter[str] = Counter()
    for m in ms:
        errors.update(m.errors)
    n = sum(m.n_requests for m in ms)
    n_err = sum(m.n_errors for m in ms)

    def pct(name: str) -> Percentiles:
        ps: list[Percentiles] = [getattr(m, name) for m in ms]
        return Percentiles(
            mean=_median(p.mean for p in ps),
            p50=_median(p.p50 for p in ps),
            p90=_median(p.p90 for p in ps),
            p99=_median(p.p99 for p in ps),
        )

    keys = sorted({k for m in ms for k in m.server})
    cv = _cv(per_repeat)
    windows = [m.window_s for m in ms if m.window_s is not None]
    rate = _median(m.output_tokens_per_s for m in ms)
    # the interval pools every repeat's segments (same server: one population of segments),
    pooled = [v for m in ms for v in m.segment_tokens_per_s]
    ci_lo, ci_hi, method = rate_interval(rate, pooled)
    # the repeats' spread, and a drift across them, widen it: one server's segments do not
    # see how far apart its repeats read
    ci_lo, ci_hi, method = held_interval(
        rate, ci_lo, ci_hi, method, repeats=per_repeat,
        segments=pooled if ms[0].segment_kind == "segments" else ())
    return Measurement(
        output_tokens_per_s=rate,
        output_tokens_per_s_ci_low=ci_lo,
        output_tokens_per_s_ci_high=ci_hi,
        ci_method=method,
        interval_note=next((m.interval_note for m in ms if m.interval_note), ""),
        segment_tokens_per_s=tuple(pooled),
        segment_kind=ms[0].segment_kind if pooled else None,
        requests_per_s=_median(m.requests_per_s for m in ms),
        goodput_rps=_median(m.goodput_rps for m in ms),
        error_rate=n_err / n if n else None,
        n_requests=n,
        n_ok=sum(m.n_ok for m in ms),
        n_errors=n_err,
        errors=dict(errors),
        window_s=sum(windows) if windows else None,
        window_rule="repeats",
        n_latency=sum(m.n_latency for m in ms),
        ttft_s=pct("ttft_s"),
        tpot_s=pct("tpot_s"),
        itl_s=pct("itl_s"),
        e2e_s=pct("e2e_s"),
        cv=cv,
        cv_kind="repeats" if cv is not None else None,
        repeats=sum(m.repeats for m in ms),
        repeat_tokens_per_s=tuple(per_repeat),
        repeat_server=tuple(r for m in ms for r in (m.repeat_server or (m.server,))),
        repeat_segments=tuple(k for m in ms
                              for k in (m.repeat_segments or (len(m.segment_tokens_per_s),))),
        total_output_tokens=sum(m.total_output_tokens for m in ms),
        server={
            k: v
            for k in keys
            if (v := _median(m.server.get(k) for m in ms)) is not None  # type: ignore[misc]
        },
        sessions={
            k: v
            for k in sorted({k for m in ms for k in m.sessions})
            if (v := _median(m.sessions.get(k) for m in ms)) is not None  # type: ignore[misc]
        },
    )
