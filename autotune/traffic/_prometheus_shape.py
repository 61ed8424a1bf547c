"""A traffic shape from vLLM's series stored in Prometheus, summed over replicas.

The same statistics as ``shape from-metrics`` (``_metrics.py``), read with PromQL over a
range ``[start, end]`` instead of from live scrapes, for every series the label selector
matches (one per replica, or per engine of a replica):

- lengths: ``sum by (le) (increase(vllm:request_prompt_tokens_bucket{SEL}[RANGE]))`` (and
  the generation histogram), ``_sum``/``_count`` the same way; quantiles and their precision
  as for /metrics (:func:`histogram_length_dist`);
- requests and rate: ``increase()`` of the arrival counter over the range;
- arrival counts per window (the rate profile, ``dispersion_60s``, the peak): per series the
  last sample of a window minus the last of the window before (exact, at scrape
  resolution), or, where the counter reset in this window or the one before (a restart: a
  restarted counter may have passed its old value already) or the window before has no
  sample (a replica that appeared), Prometheus' ``increase()`` over the window;
- concurrency by Little's law with the mean end-to-end latency; prefix sharing from the
  prefix-cache counters.

``increase()`` handles counter resets sample by sample; restarts (``resets()``) and gaps
(windows where a replica has no samples, or fewer than half the samples of the fullest one)
are reported with the shape. docs/traffic.md section 10 has the details and the precision.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import numpy as np

from autotune.errors import ConfigError
from autotune.traffic._metrics import (
    METRIC_NAMES,
    Histogram,
    NoTrafficError,
    histogram_length_dist,
)
from autotune.traffic._models import (
    ArrivalStats,
    ConcurrencyEstimate,
    LoadSpec,
    Precision,
    PrefixStats,
    PrometheusRange,
    SourceInfo,
    TrafficShape,
)
from autotune.traffic._prometheus import PrometheusClient, PrometheusError
from autotune.traffic._shape import (
    DEFAULT_REPLAY_REQUESTS,
    DISPERSION_WINDOW_S,
    _r,
    dispersion,
    stats_fingerprint,
)

__all__ = [
    "NoSeriesError",
    "PrometheusFit",
    "fit_prometheus",
    "normalize_selector",
]

logger = logging.getLogger(__name__)

#: the label names that tell replicas apart in messages (the first ones present)
_REPLICA_LABELS: Final = ("instance", "pod", "job", "engine", "model_name")
_MATCHER = re.compile(r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*')


class NoSeriesError(NoTrafficError):
    """No vLLM series matches the selector in the range."""


def normalize_selector(text: str | None) -> str:
    """``{a="b",c=~"d"}`` (or the same without braces, or empty) -> ``a="b",c=~"d"``.

    Raises :class:`ConfigError` for anything that is not a list of label matchers."""
    t = (text or "").strip()
    if t.startswith("{") != t.endswith("}"):
        raise ConfigError(f"--selector {text!r}: unbalanced braces; write it as "
                          "'{model_name=\"M\",namespace=\"N\"}'")
    inner = t[1:-1].strip() if t.startswith("{") else t
    pos, parts = 0, []
    while pos < len(inner):
        m = _MATCHER.match(inner, pos)
        if m is None:
            raise ConfigError(
                f"--selector {text!r}: {inner[pos:pos + 30]!r} is not a label matcher; write "
                "label=\"value\" (or =~, !=, !~), comma-separated, e.g. "
                "'{model_name=\"M\",namespace=\"N\"}'")
        parts.append(m.group(0).strip())
        pos = m.end()
        if pos < len(inner):
            if inner[pos] != ",":
                raise ConfigError(f"--selector {text!r}: expected ',' at {inner[pos:pos+20]!r}")
            pos += 1
    if any(p.startswith("__name__") for p in parts):
        raise ConfigError(f"--selector {text!r}: select by labels, not by metric name "
                          "(__name__): the vLLM series are chosen by autotune")
    return ",".join(parts)


def _sel(name: str, inner: str) -> str:
    return f"{name}{{{inner}}}" if inner else name


def _dur(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _who(labels: Mapping[str, str]) -> str:
    keys = [k for k in _REPLICA_LABELS if k in labels][:2] or sorted(labels)[:2]
    return ",".join(f'{k}="{labels[k]}"' for k in keys) or "{}"


@dataclass
class PrometheusFit:
    """A shape fitted from Prometheus, and what the user should know about how."""

    shape: TrafficShape
    replicas: list[str]
    resets: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)
    windows: int = 0
    window_arrivals: float = 0.0
    arrivals: float = 0.0
    scrape_interval_s: float | None = None
    failed_requests: int = 0
    queries: int = 0
    names: dict[str, str] = field(default_factory=dict)
    clipped: list[str] = field(default_factory=list)


class _Reader:
    """Runs the queries of one fit and keeps their texts (recorded in the shape)."""

    def __init__(self, client: PrometheusClient, inner: str, start: float, end: float,
                 on_query: Callable[[str], None] | None) -> None:
        self.client, self.inner, self.start, self.end = client, inner, start, end
        self.range = _dur(end - start)
        self.queries: dict[str, str] = {}
        self.on_query = on_query

    def instant(self, key: str, expr: str) -> list[Any]:
        self.queries[key] = expr
        if self.on_query:
            self.on_query(key)
        return self.client.query(expr, at=self.end)

    def total(self, key: str, name: str | None) -> float | None:
        """``sum(increase(NAME{SEL}[RANGE]))``; None when the series are absent."""
        if name is None:
            return None
        res = self.instant(key, f"sum(increase({_sel(name, self.inner)}[{self.range}]))")
        vals = [s.value for s in res if math.isfinite(s.value)]
        return float(sum(vals)) if vals else None

    def histogram(self, key: str, base: str) -> Histogram | None:
        res = self.instant(key, f"sum by (le) (increase({_sel(base + '_bucket', self.inner)}"
                                f"[{self.range}]))")
        cum: dict[float, float] = {}
        for s in res:
            try:
                le = float(s.labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(le) and math.isfinite(s.value):
                cum[le] = s.value
        les = sorted(cum)
        if not les or not math.isinf(les[-1]):
            return None
        # increase() extrapolates each bucket on its own: keep the cumulative counts monotone
        c = np.maximum.accumulate(np.asarray([cum[le] for le in les]))
        counts = np.diff(np.concatenate(([0.0], c)))
        total = self.total(key + "_sum", base + "_sum") or 0.0
        count = self.total(key + "_count", base + "_count")
        return Histogram(bounds=tuple(les[:-1]), counts=tuple(float(v) for v in counts),
                         sum=total, count=float(count if count is not None else c[-1]))

    def matrix(self, key: str, expr: str, *, step: float, first: float, last: float
               ) -> dict[float, float]:
        """A range query summed to one series: step time -> value."""
        self.queries[key] = expr
        if self.on_query:
            self.on_query(key)
        out: dict[float, float] = {}
        for s in self.client.query_range(expr, start=first, end=last, step=step):
            for t, v in s.points:
                if math.isfinite(v):
                    out[round(t, 3)] = out.get(round(t, 3), 0.0) + v
        return out


def _names(client: PrometheusClient, inner: str, start: float, end: float
           ) -> tuple[dict[str, str], list[dict[str, str]]]:
    """Which of METRIC_NAMES' candidates exist in the range (first found per statistic), and
    the label sets of the prompt-token series (one per replica)."""
    cands = {n + ("_count" if not k.startswith("prefix") else "")
             for k, names in METRIC_NAMES.items() for n in names}
    match = "{" + f'__name__=~"{"|".join(sorted(cands))}"' + (f",{inner}" if inner else "")
    match += "}"
    found = client.series(match, start=start, end=end)
    present = {d.get("__name__", "") for d in found}
    names: dict[str, str] = {}
    for key, options in METRIC_NAMES.items():
        suffix = "" if key.startswith("prefix") else "_count"
        hit = next((n for n in options if n + suffix in present), None)
        if hit is not None:
            names[key] = hit
    replicas = [{k: v for k, v in d.items() if k != "__name__"} for d in found
                if d.get("__name__") == METRIC_NAMES["prompt_tokens"][0] + "_count"]
    return names, replicas


def _explain_empty(client: PrometheusClient, inner: str, start: float, end: float,
                   selector: str) -> NoSeriesError:
    """Why nothing matched: the selector, the range, or no vLLM at all."""
    name = METRIC_NAMES["prompt_tokens"][0] + "_count"
    span = f"between {_iso(start)} and {_iso(end)}"
    if inner:
        others = client.series(name, start=start, end=end)
        if others:
            labels = sorted({k for d in others for k in d if k != "__name__"})
            return NoSeriesError(
                f"the selector {selector} matches no vLLM series at {client.url} {span} "
                f"({len(others)} {name} series match without it; their labels: "
                f"{', '.join(labels)}); fix --selector")
    ever = client.series(name, start=0.0, end=end + 86400.0)
    if ever:
        return NoSeriesError(
            f"Prometheus at {client.url} has no vLLM data {span} (it has {name} outside this "
            "range); move --since/--until to when the servers ran")
    return NoSeriesError(
        f"Prometheus at {client.url} has no vLLM series ({name}) at all: is it scraping the "
        "vLLM servers' /metrics (a scrape job per server), started with metrics on?")


def fit_prometheus(
    client: PrometheusClient,
    *,
    start: float,
    end: float,
    selector: str | None = None,
    name: str | None = None,
    load: LoadSpec | None = None,
    on_query: Callable[[str], None] | None = None,
) -> PrometheusFit:
    """The shape of the traffic the series matching ``selector`` served in ``[start, end]``
    (unix seconds), summed over replicas. Raises :class:`NoSeriesError` when no vLLM series
    matches (the message says whether the selector or the range is why),
    :class:`NoTrafficError` when they served no request, :class:`PrometheusError` /
    ``PrometheusUnreachableError`` for the server."""
    if not (math.isfinite(start) and math.isfinite(end) and end > start):
        raise ConfigError(f"the range must end after it starts (got {_iso(start)} .. "
                          f"{_iso(end)})")
    inner = normalize_selector(selector)
    shown = "{" + inner + "}"
    names, replicas = _names(client, inner, start, end)
    if "prompt_tokens" not in names or not replicas:
        raise _explain_empty(client, inner, start, end, shown)
    arrivals_name = names.get("arrivals", names["prompt_tokens"])
    start, end, clipped = _clip_range(client, _sel(arrivals_name + "_count", inner), start,
                                      end)
    rd = _Reader(client, inner, start, end, on_query)
    prompt = rd.histogram("prompt_tokens", names["prompt_tokens"])
    gen = rd.histogram("generation_tokens", names.get("generation_tokens", ""))
    span = f"between {_iso(start)} and {_iso(end)}"
    if prompt is None or gen is None or prompt.count < 0.5 or gen.count < 0.5:
        raise NoTrafficError(f"the {len(replicas)} vLLM series matching {shown} at "
                             f"{client.url} finished no request {span}")
    inp, prec_in = histogram_length_dist(prompt)
    out, prec_out = histogram_length_dist(gen)
    duration = end - start
    arrived = rd.total("arrivals", arrivals_name + "_count") or prompt.count
    rate = arrived / duration
    fit = PrometheusFit(shape=None,  # type: ignore[arg-type]  # set below
                        replicas=[_who(r) for r in replicas], arrivals=arrived, names=names,
                        clipped=clipped)
    profile = _windows(rd, arrivals_name + "_count", len(replicas), fit)
    _resets(rd, names["prompt_tokens"] + "_count", fit)
    fit.failed_requests = _failed(rd)
    concurrency = None
    if "e2e_latency" in names:
        e_sum = rd.total("e2e_latency_sum", names["e2e_latency"] + "_sum")
        e_cnt = rd.total("e2e_latency_count", names["e2e_latency"] + "_count")
        if e_sum and e_cnt and e_cnt > 0 and rate > 0:
            w = e_sum / e_cnt
            concurrency = ConcurrencyEstimate(mean=_r(rate * w), method="latency",
                                              mean_latency_s=_r(w))
    prefix = None
    queried = rd.total("prefix_queries", names.get("prefix_queries"))
    hit = rd.total("prefix_hits", names.get("prefix_hits"))
    if queried and queried > 0 and hit is not None:
        prefix = PrefixStats(source="server_cache", shared_token_fraction=_r(min(1.0,
                             max(0.0, hit / queried))), sharing_request_fraction=0.0,
                             groups=0, mean_group_size=0.0)
    n = max(round(prompt.count), 1)
    stats: dict[str, Any] = {
        "requests": n, "duration_s": _r(duration), "rate_rps": _r(rate),
        "input_tokens": inp, "output_tokens": out, "correlation": None,
        "arrivals": profile, "concurrency": concurrency, "prefix": prefix,
    }
    rng = PrometheusRange(url=client.url, selector=shown, start=_r3(start), end=_r3(end),
                          start_iso=_iso(start), end_iso=_iso(end),
                          window_s=profile.window_s if profile else _r(duration),
                          replicas=len(replicas), queries=dict(rd.queries))
    rate_prec = _rate_precision(fit, duration)
    fit.queries = client.requests
    fit.shape = TrafficShape(
        name=name or "prometheus",
        fingerprint=stats_fingerprint(stats),
        source=SourceInfo(path=client.url, format="prometheus", prometheus=rng,
                          failed_requests=fit.failed_requests, note=_note(fit)),
        precision=Precision(
            input_tokens=prec_in, output_tokens=prec_out, rate=rate_prec,
            note=("lengths from histogram buckets (upper bounds "
                  f"{', '.join(f'{b:g}' for b in prompt.bounds)}): a bound on W1/mean "
                  "between the true and the stored distribution; rate: counts from "
                  "Prometheus' increase(), extrapolated by up to a scrape interval per "
                  "replica at each end of the range. No input/output correlation, no "
                  "inter-arrival CV; prefix sharing is the server cache's hit share"),
        ),
        load=load or LoadSpec(mode="open", requests=min(n, DEFAULT_REPLAY_REQUESTS)),
        **stats,
    )
    return fit


def _clip_range(client: PrometheusClient, series: str, start: float, end: float
                ) -> tuple[float, float, list[str]]:
    """The range without its leading and trailing windows in which no matched series has a
    sample (Prometheus or the servers were not there yet, or any more): counted as time
    without traffic they would dilute the rate. Window-granular; the cut is reported."""
    duration = end - start
    window = DISPERSION_WINDOW_S if duration >= DISPERSION_WINDOW_S else duration
    k = math.floor(duration / window + 1e-9)
    if k < 2:
        return start, end, []
    steps = [start + (i + 1) * window for i in range(k)]
    pts: set[float] = set()
    for s in client.query_range(f"count(last_over_time({series}[{_dur(window)}]))",
                                start=steps[0], end=steps[-1], step=window):
        pts.update(round(t, 3) for t, v in s.points if v > 0)
    have = [i for i, t in enumerate(steps) if round(t, 3) in pts]
    if not have:
        return start, end, []
    notes = []
    new_start, new_end = start + have[0] * window, end
    if have[-1] < k - 1:
        new_end = steps[have[-1]]
        notes.append(f"no vLLM series after {_iso(new_end)}: the range ends there "
                     f"(asked until {_iso(end)})")
    if have[0] > 0:
        notes.append(f"no vLLM series before {_iso(new_start)}: the range starts there "
                     f"(asked from {_iso(start)})")
    return new_start, new_end, notes


def _r3(t: float) -> float:
    return round(float(t), 3)


def _windows(rd: _Reader, counter: str, n_replicas: int, fit: PrometheusFit
             ) -> ArrivalStats | None:
    """Arrival counts per full window from ``start``; gaps found on the way go to ``fit``."""
    duration = rd.end - rd.start
    window = DISPERSION_WINDOW_S if duration >= DISPERSION_WINDOW_S else duration
    k = math.floor(duration / window + 1e-9)
    fit.windows = k
    if k < 1:
        return None
    w, x = _dur(window), _sel(counter, rd.inner)
    # steps at the full windows' ends
    at = {"step": window, "first": rd.start + window, "last": rd.start + k * window}
    counts = rd.matrix(
        "arrivals_per_window",
        f"sum(((last_over_time({x}[{w}]) - last_over_time({x}[{w}] offset {w})) >= 0 "
        f"unless resets({x}[{_dur(2 * window)}]) > 0) or increase({x}[{w}]))", **at)
    present = rd.matrix("replicas_per_window", f"count(last_over_time({x}[{w}]))", **at)
    fewest = rd.matrix("fewest_samples_per_window", f"min(count_over_time({x}[{w}]))", **at)
    most = rd.matrix("most_samples_per_window", f"max(count_over_time({x}[{w}]))", **at)
    first = at["first"]
    steps = [round(first + i * window, 3) for i in range(k)]
    per = np.asarray([max(0.0, counts.get(t, 0.0)) for t in steps])
    fit.window_arrivals = float(per.sum())
    full = [most[t] for t in steps if t in most]
    if full:
        fit.scrape_interval_s = _r(window / max(float(np.median(full)), 1.0))
    gaps = []
    for i, t in enumerate(steps):
        p, lo, hi = present.get(t, 0.0), fewest.get(t, 0.0), most.get(t, 0.0)
        if p < n_replicas or lo < hi / 2.0:
            what = (f"{n_replicas - round(p)} of {n_replicas} replica(s) without samples"
                    if p < n_replicas else f"a replica with {lo:.0f} samples (the fullest "
                    f"{hi:.0f}): scrapes missed or it was down")
            gaps.append(f"window {i + 1} ({_iso(t - window)} .. {_iso(t)}): {what}")
    fit.gaps = gaps
    disp = dispersion(per) if window == DISPERSION_WINDOW_S else None
    profile = per / window
    return ArrivalStats(
        interarrival_cv=None, dispersion_60s=_r(disp) if disp is not None else None,
        zero_gap_fraction=0.0, peak_rate_rps=_r(float(profile.max())), window_s=_r(window),
        rate_profile=[_r(v) for v in profile])


def _resets(rd: _Reader, counter: str, fit: PrometheusFit) -> None:
    res = rd.instant("resets", f"resets({_sel(counter, rd.inner)}[{rd.range}]) > 0")
    fit.resets = [f"{_who(s.labels)}: its counters restarted {s.value:.0f} time(s)"
                  for s in res if math.isfinite(s.value)]


def _failed(rd: _Reader) -> int:
    """Requests that ended with ``abort`` or ``error`` (vllm:request_success_total)."""
    try:
        res = rd.instant("finished_reasons", "sum by (finished_reason) (increase("
                         f"{_sel('vllm:request_success_total', rd.inner)}[{rd.range}]))")
    except PrometheusError:
        return 0
    bad = sum(s.value for s in res if s.labels.get("finished_reason") in ("abort", "error")
              and math.isfinite(s.value))
    return max(0, round(bad))


def _rate_precision(fit: PrometheusFit, duration: float) -> float | None:
    if fit.scrape_interval_s is None:
        return None
    # increase() extrapolates each series by at most ~1.1 scrape intervals at either end
    return _r(min(1.0, 2.2 * fit.scrape_interval_s / duration))


def _note(fit: PrometheusFit) -> str:
    parts = [f"{len(fit.replicas)} series summed ({'; '.join(fit.replicas[:5])}"
             + (" ..." if len(fit.replicas) > 5 else "") + ")"]
    if fit.scrape_interval_s is not None:
        parts.append(f"scrape interval ~{fit.scrape_interval_s:g} s")
    parts.extend(fit.clipped)
    parts.append(f"{fit.window_arrivals:.0f} of {fit.arrivals:.0f} arrivals counted in "
                 f"{fit.windows} full window(s)")
    if fit.resets:
        parts.append("counter resets: " + "; ".join(fit.resets))
    if fit.gaps:
        parts.append(f"{len(fit.gaps)} window(s) with gaps")
    return "; ".join(parts)
