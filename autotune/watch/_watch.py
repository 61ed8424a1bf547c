"""Live traffic: sample a vLLM server's ``/metrics`` into shapes and watch them for drift.

:func:`sample_shape` scrapes ``/metrics`` for a while and builds the traffic shape of that
window (:func:`autotune.traffic.shape_from_samples`). :func:`watch` does it window after
window, compares each shape with the tuned one (:func:`autotune.traffic.diff_shapes`) and
calls ``on_drift`` once per drift episode. Subscribers (:class:`WatchCallback`: the JSON
lines log, MLflow) see every state. See docs/traffic.md section 8.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, ParamSpec, Protocol, TypeVar

from autotune.errors import TrafficError
from autotune.traffic import ShapeDiff, TrafficShape, diff_shapes, save_shape
from autotune.traffic._metrics import (
    MetricsSample,
    NoTrafficError,
    NotVllmError,
    parse_vllm_metrics,
    shape_from_samples,
)

__all__ = [
    "EndpointUnreachableError",
    "JsonlLog",
    "MetricsWindows",
    "MlflowWatchLog",
    "WatchCallback",
    "WatchEvent",
    "WatchSummary",
    "WindowSource",
    "default_interval",
    "fetch_metrics",
    "metrics_url",
    "run_command",
    "sample_shape",
    "sample_window",
    "served_model",
    "watch",
]

if TYPE_CHECKING:
    import numpy as np

_P = ParamSpec("_P")
_R = TypeVar("_R")

logger = logging.getLogger(__name__)

State = Literal["same", "drifted", "idle", "unreachable", "not_vllm"]
#: retry delays after the endpoint went away: doubling from the first, capped at the last
BACKOFF_S: Final = (1.0, 60.0)


class EndpointUnreachableError(TrafficError):
    """The endpoint did not answer (refused, timed out, DNS, HTTP error)."""


def metrics_url(url: str) -> str:
    """``http://host:port`` or ``.../metrics`` -> the /metrics URL."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise TrafficError(f"endpoint {url!r} must start with http:// or https://")
    return u if u.endswith("/metrics") else u + "/metrics"


def served_model(url: str, *, timeout_s: float = 5.0) -> str | None:
    """The model the vLLM server at ``url`` serves, as it was started (``/v1/models``: the
    first model's ``root``, its ``--model``, else its ``id``); None when it does not say
    (unreachable, not vLLM, no model): a hint for a printed command, never an error."""
    base = metrics_url(url).removesuffix("/metrics")
    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=timeout_s) as resp:
            data = json.loads(resp.read().decode("utf-8", errors="replace")).get("data") or []
    except (urllib.error.URLError, OSError, TimeoutError, ValueError, AttributeError):
        return None  # the watch itself reports an endpoint it cannot read
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    name = first.get("root") or first.get("id")
    return str(name) if name else None


def fetch_metrics(url: str, *, timeout_s: float = 10.0) -> str:
    """GET the /metrics page; :class:`EndpointUnreachableError` on any transport failure,
    :class:`NotVllmError` when it has no /metrics (HTTP 404)."""
    target = metrics_url(url)
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            return str(resp.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise NotVllmError(
                f"{target} answered 404: the endpoint serves no /metrics; point at the vLLM "
                "server itself (not a proxy), started without --disable-metrics"
            ) from exc
        raise EndpointUnreachableError(f"{target} answered HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise EndpointUnreachableError(
            f"cannot reach {target}: {reason}; is the server running and the URL right?"
        ) from exc


def _scrape(url: str, clock: Callable[[], float], timeout_s: float) -> MetricsSample:
    text = fetch_metrics(url, timeout_s=timeout_s)
    return parse_vllm_metrics(text, taken_at=clock(), wall_at=time.time())


def default_interval(duration_s: float) -> float:
    """Scrape interval: about 20 per window, between 0.5 and 10 s."""
    return min(10.0, max(0.5, duration_s / 20.0))


def _sleep_until(deadline: float, clock: Callable[[], float], stop: threading.Event) -> bool:
    """Wait until ``deadline``; False if ``stop`` was set first."""
    while True:
        left = deadline - clock()
        if left <= 0:
            return True
        if stop.wait(min(left, 1.0)):
            return False


def sample_window(
    *,
    url: str,
    duration_s: float,
    interval_s: float | None = None,
    first: MetricsSample | None = None,
    on_progress: Callable[[float, int, float], None] | None = None,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    timeout_s: float = 10.0,
) -> list[MetricsSample]:
    """Scrape ``url``'s /metrics every ``interval_s`` for ``duration_s``: the samples.

    ``first``: a sample to start from (the last one of the previous window, so that back to
    back windows leave no gap). ``on_progress(elapsed_s, samples, requests_finished)`` after
    each scrape. A scrape that fails mid-window is skipped (logged); a failing first or last
    scrape raises :class:`EndpointUnreachableError`. ``stop`` ends the window early.
    """
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise TrafficError(f"the sampling duration must be > 0 s (got {duration_s})")
    interval = interval_s if interval_s is not None else default_interval(duration_s)
    if not interval > 0:
        raise TrafficError(f"the scrape interval must be > 0 s (got {interval_s})")
    stop = stop or threading.Event()
    samples = [first if first is not None else _scrape(url, clock, timeout_s)]
    start = samples[0].taken_at
    end = start + duration_s
    k = 1
    while True:
        target = min(start + k * interval, end)
        if not _sleep_until(target, clock, stop):
            break
        k += 1
        try:
            samples.append(_scrape(url, clock, timeout_s))
        except EndpointUnreachableError as exc:
            if target >= end:
                raise
            logger.warning("%s (sample skipped)", exc)
            continue
        if on_progress is not None:
            on_progress(samples[-1].taken_at - start, len(samples), _finished(samples))
        if target >= end:
            break
    return samples


def sample_shape(
    *,
    url: str,
    duration_s: float,
    interval_s: float | None = None,
    name: str | None = None,
    on_progress: Callable[[float, int, float], None] | None = None,
    stop: threading.Event | None = None,
    request_log: str | Path | None = None,
) -> TrafficShape:
    """The shape of ``url``'s traffic over the next ``duration_s`` (see
    :func:`sample_window`); arrivals from the server's ``request_log`` file when given.
    Raises :class:`NoTrafficError` when no request finished."""
    samples = sample_window(url=url, duration_s=duration_s, interval_s=interval_s,
                            on_progress=on_progress, stop=stop)
    return shape_from_samples(samples, url=metrics_url(url), name=name,
                              request_log=_log_arrivals(request_log))


def _log_arrivals(path: str | Path | None) -> np.ndarray | None:
    if path is None:
        return None
    from autotune.traffic._vllm_log import read_vllm_request_log

    return read_vllm_request_log(path)


def _finished(samples: Sequence[MetricsSample]) -> float:
    from autotune.traffic._metrics import METRIC_NAMES, counter_delta

    name = METRIC_NAMES["prompt_tokens"][0]
    total = 0.0
    for a, b in pairwise(samples):
        ha, hb = a.histograms.get(name), b.histograms.get(name)
        total += counter_delta(ha.count if ha else None, hb.count if hb else None) or 0.0
    return total


# --- the watch loop -----------------------------------------------------------------------


@dataclass(frozen=True)
class WatchEvent:
    """One state of the watch: a comparison ("same"/"drifted"), a window without finished
    requests ("idle"), or the endpoint not answering ("unreachable"/"not_vllm")."""

    check: int
    time: str
    state: State
    distance: float | None = None
    drifted_dimensions: list[str] = field(default_factory=list)
    shape_path: str | None = None
    fingerprint: str | None = None
    requests: int | None = None
    rate_rps: float | None = None
    action: str | None = None  # "printed", "ran: rc=0", ... on the first drift of an episode
    armed: bool = True  # whether the next drift fires the action
    message: str | None = None
    dimensions: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class WatchSummary:
    """What a watch did: comparisons, drifts, actions, and how it ended."""

    checks: int = 0
    same: int = 0
    drifted: int = 0
    actions: int = 0
    idle: int = 0
    unreachable: int = 0
    interrupted: bool = False
    events: list[WatchEvent] = field(default_factory=list)

    def line(self) -> str:
        end = "interrupted" if self.interrupted else "done"
        return (f"watch {end}: {self.checks} comparison(s) ({self.same} same, {self.drifted} "
                f"drifted), {self.actions} drift action(s), {self.idle} idle window(s), "
                f"{self.unreachable} unreachable attempt(s)")


class WatchCallback(Protocol):
    """A subscriber to a watch. Contract: methods must not raise (log and carry on); the
    loop runs with none."""

    def on_start(self, *, url: str, tuned: TrafficShape, every_s: float) -> None: ...
    def on_event(self, event: WatchEvent, diff: ShapeDiff | None) -> None: ...
    def on_end(self, summary: WatchSummary) -> None: ...


class JsonlLog:
    """Appends every state as one JSON line to ``path`` (flushed at once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _write(self, obj: Mapping[str, object]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")

    def on_start(self, *, url: str, tuned: TrafficShape, every_s: float) -> None:
        self._write({"event": "start", "time": _now(), "url": url, "tuned": tuned.name,
                     "tuned_fingerprint": tuned.fingerprint, "every_s": every_s})

    def on_event(self, event: WatchEvent, diff: ShapeDiff | None) -> None:
        self._write({"event": "state", **event.to_dict()})

    def on_end(self, summary: WatchSummary) -> None:
        self._write({"event": "end", "time": _now(), "summary": summary.line(),
                     "interrupted": summary.interrupted, "checks": summary.checks,
                     "actions": summary.actions})


class MlflowWatchLog:
    """One MLflow run per watch (experiment ``autotune-watch``); per comparison the metrics
    ``distance``, ``drifted`` (0/1), ``rate_rps`` and each dimension's distance, at step =
    the comparison's number. A failing store is reported once and then left alone."""

    def __init__(self, tracking_uri: str, *, experiment: str = "autotune-watch") -> None:
        from autotune.results import MlflowTracker

        self.tracker = MlflowTracker(tracking_uri, experiment=experiment)  # checks the store
        self.client = self.tracker.client
        self.run_id: str | None = None
        self.failed: str | None = None

    def _safe(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        if self.failed is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - tracking must never stop the watch
            self.failed = f"{type(exc).__name__}: {str(exc)[:200]}"
            logger.warning("MLflow: %s; no more MLflow writes for this watch", self.failed)
            return None

    def on_start(self, *, url: str, tuned: TrafficShape, every_s: float) -> None:
        run = self._safe(self.client.create_run, self.tracker.experiment_id,
                         run_name=f"watch {url}",
                         tags={"autotune.kind": "watch", "autotune.shape_fingerprint":
                               tuned.fingerprint, "autotune.shape_name": tuned.name})
        if run is None:
            return
        self.run_id = run.info.run_id
        for k, v in (("url", url), ("tuned_shape", tuned.name),
                     ("tuned_fingerprint", tuned.fingerprint), ("every_s", every_s)):
            self._safe(self.client.log_param, self.run_id, k, str(v))

    def on_event(self, event: WatchEvent, diff: ShapeDiff | None) -> None:
        if self.run_id is None:
            return
        ts = int(time.time() * 1000)
        metrics: dict[str, float] = {"state_" + event.state: 1.0}
        if event.distance is not None:
            metrics["distance"] = event.distance
            metrics["drifted"] = 1.0 if event.state == "drifted" else 0.0
        if event.rate_rps is not None:
            metrics["rate_rps"] = event.rate_rps
        for k, v in event.dimensions.items():
            if v is not None:
                metrics[f"dim_{k}"] = v
        from mlflow.entities import Metric

        self._safe(self.client.log_batch, self.run_id,
                   metrics=[Metric(k, float(v), ts, event.check) for k, v in metrics.items()])
        if event.action is not None:
            self._safe(self.client.set_tag, self.run_id, f"drift_action_{event.check}",
                       event.action)

    def on_end(self, summary: WatchSummary) -> None:
        if self.run_id is None:
            return
        self._safe(self.client.set_tag, self.run_id, "summary", summary.line())
        self._safe(self.client.set_terminated, self.run_id,
                   "KILLED" if summary.interrupted else "FINISHED")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


DriftAction = Callable[[TrafficShape, Path, ShapeDiff], str]


class WindowSource(Protocol):
    """Where :func:`watch`'s window shapes come from. Contract: ``next_shape(name, stop)``
    waits for the next window and returns its shape, or None when ``stop`` was set
    meanwhile; it raises :class:`EndpointUnreachableError` / :class:`NotVllmError` (watch
    retries after ``reset()``) and :class:`NoTrafficError` (an idle window)."""

    def next_shape(self, name: str, stop: threading.Event) -> TrafficShape | None: ...
    def reset(self) -> None: ...


class MetricsWindows:
    """Windows sampled from a server's /metrics, back to back (one window's last scrape is
    the next one's first); after a failure the next window starts from a fresh scrape."""

    def __init__(self, *, url: str, every_s: float, interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 request_log: str | Path | None = None) -> None:
        self.url, self.every_s, self.interval_s = url, every_s, interval_s
        self.clock, self.request_log = clock, request_log
        self.last: MetricsSample | None = None

    def next_shape(self, name: str, stop: threading.Event) -> TrafficShape | None:
        samples = sample_window(url=self.url, duration_s=self.every_s,
                                interval_s=self.interval_s, first=self.last, stop=stop,
                                clock=self.clock)
        self.last = samples[-1]
        if stop.is_set():
            return None
        return shape_from_samples(samples, url=metrics_url(self.url), name=name,
                                  request_log=_log_arrivals(self.request_log))

    def reset(self) -> None:
        self.last = None


def watch(
    *,
    url: str,
    tuned: TrafficShape,
    every_s: float = 600.0,
    interval_s: float | None = None,
    shapes_dir: str | Path,
    on_drift: DriftAction | None = None,
    callbacks: Sequence[WatchCallback] = (),
    max_checks: int | None = None,
    stop: threading.Event | None = None,
    backoff_s: tuple[float, float] = BACKOFF_S,
    clock: Callable[[], float] = time.monotonic,
    request_log: str | Path | None = None,
    source: WindowSource | None = None,
) -> WatchSummary:
    """Build a shape every ``every_s`` seconds from ``url``'s /metrics and compare it with
    ``tuned``, until ``max_checks`` comparisons, ``stop`` or Ctrl-C (then
    ``summary.interrupted``; KeyboardInterrupt does not escape).

    Each window's shape is saved in ``shapes_dir``. On "drifted", ``on_drift(shape, path,
    diff)`` runs (its return value is recorded as the event's ``action``), once per drift
    episode: it is re-armed only by a comparison that says "same" again. The tuned shape
    stays the reference (watch a new study to change it). An unreachable endpoint is retried
    with doubling delays (``backoff_s`` = first, cap); the next window starts afresh.
    ``request_log``: the server's log file, re-read each window for arrival times.
    ``source``: where the window shapes come from (default: ``url``'s /metrics, sampled;
    :class:`autotune.watch.PrometheusWindows` reads them from Prometheus).
    """
    if not (every_s > 0 and math.isfinite(every_s)):
        raise TrafficError(f"--every must be > 0 s (got {every_s})")
    stop = stop or threading.Event()
    out = Path(shapes_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = WatchSummary()
    armed = True
    delay = backoff_s[0]
    attempt = 0
    windows = source or MetricsWindows(url=url, every_s=every_s, interval_s=interval_s,
                                       clock=clock, request_log=request_log)

    def emit(ev: WatchEvent, diff: ShapeDiff | None = None) -> None:
        summary.events.append(ev)
        for cb in callbacks:
            cb.on_event(ev, diff)

    try:
        for cb in callbacks:
            cb.on_start(url=url, tuned=tuned, every_s=every_s)
        while not stop.is_set() and (max_checks is None or summary.checks < max_checks):
            attempt += 1
            try:
                shape = windows.next_shape(f"live-{attempt}", stop)
                if shape is None:
                    break  # a window cut short by Ctrl-C is not compared
            except (EndpointUnreachableError, NotVllmError) as exc:
                windows.reset()
                state: State = ("not_vllm" if isinstance(exc, NotVllmError)
                                else "unreachable")
                summary.unreachable += 1
                emit(WatchEvent(check=summary.checks, time=_now(), state=state, armed=armed,
                                message=f"{exc}; retrying in {delay:g} s"))
                if stop.wait(delay):
                    break
                delay = min(delay * 2.0, backoff_s[1])
                continue
            except NoTrafficError as exc:
                summary.idle += 1
                emit(WatchEvent(check=summary.checks, time=_now(), state="idle", armed=armed,
                                message=str(exc)))
                continue
            delay = backoff_s[0]
            summary.checks += 1
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
            path = out / f"live-{summary.checks:04d}-{stamp}.json"
            save_shape(shape, path)
            diff = diff_shapes(tuned, shape)
            action = None
            if diff.verdict == "drifted":
                summary.drifted += 1
                if armed:
                    armed = False
                    summary.actions += 1
                    action = on_drift(shape, path, diff) if on_drift is not None else "none"
            else:
                summary.same += 1
                armed = True
            emit(WatchEvent(
                check=summary.checks, time=_now(), state=diff.verdict,
                distance=diff.distance, drifted_dimensions=list(diff.drifted_dimensions),
                shape_path=str(path), fingerprint=shape.fingerprint, requests=shape.requests,
                rate_rps=shape.rate_rps, action=action, armed=armed,
                dimensions={k: d.distance for k, d in diff.dimensions.items()},
            ), diff)
    except KeyboardInterrupt:
        summary.interrupted = True
    if stop.is_set():
        summary.interrupted = True
    for cb in callbacks:
        cb.on_end(summary)
    return summary


def run_command(command: str, shape_path: Path, diff: ShapeDiff, *,
                tuned_path: str | None = None) -> int:
    """Run ``command`` through the shell with the new shape: ``{shape}`` in it is replaced
    by the path (else the path is appended as the last argument), and the environment has
    ``AUTOTUNE_SHAPE`` (the path), ``AUTOTUNE_TUNED_SHAPE`` and ``AUTOTUNE_DRIFTED`` (the
    drifted dimensions, comma-separated). Returns its exit status."""
    import shlex
    import subprocess

    quoted = shlex.quote(str(shape_path))
    cmd = command.replace("{shape}", quoted) if "{shape}" in command else f"{command} {quoted}"
    env = dict(os.environ)
    env["AUTOTUNE_SHAPE"] = str(shape_path)
    env["AUTOTUNE_DRIFTED"] = ",".join(diff.drifted_dimensions)
    if tuned_path:
        env["AUTOTUNE_TUNED_SHAPE"] = tuned_path
    return subprocess.run(cmd, shell=True, env=env, check=False).returncode
