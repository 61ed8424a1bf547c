"""The server's own figures: fetch ``/metrics`` and parse it into a :class:`ServerSnapshot`.

The client side of vLLM's Prometheus endpoint, used by the trial (a snapshot before and
after each replay) and the load generator (samples during a run). What the figures mean
and how they become a Measurement's ``server`` block is :mod:`autotune.measure`'s concern.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from autotune.errors import LoadgenError
from autotune.load import _http

__all__ = [
    "ServerSnapshot",
    "fetch_metrics_text",
    "parse_metrics",
    "scrape_metrics",
    "snapshot_metrics",
]


class ServerSnapshot(BaseModel):
    """The ``vllm:`` counters, gauges and histogram (sum, count) pairs at one instant.

    Values are summed over label sets (engines, finish reasons); gauges named ``*_perc``
    are averaged instead.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    taken_at: float  # time.time()
    counters: dict[str, float] = Field(default_factory=dict)
    gauges: dict[str, float] = Field(default_factory=dict)
    histograms: dict[str, tuple[float, float]] = Field(default_factory=dict)


def _relevant(text: str, prefix: str) -> str:
    """The lines a snapshot uses: ``prefix`` families, no ``_bucket`` or ``_created`` series.

    Histogram buckets are most of a vLLM /metrics page; leaving them out before the
    prometheus_client parser sees the text makes parsing about 10x faster.
    """
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if (
                len(parts) >= 3
                and parts[2].startswith(prefix)
                and not parts[2].endswith("_created")
            ):
                keep.append(line)
        elif line.startswith(prefix):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if not name.endswith(("_bucket", "_created")):
                keep.append(line)
    return "\n".join(keep) + "\n"


def parse_metrics(text: str, *, taken_at: float, prefix: str = "vllm:") -> ServerSnapshot:
    """Parse Prometheus text exposition into a :class:`ServerSnapshot` (pure)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    gauges: dict[str, list[float]] = {}
    hists: dict[str, list[float]] = {}
    try:
        for fam in text_string_to_metric_families(_relevant(text, prefix)):
            name = fam.name
            if not name.startswith(prefix) or name.endswith("_created"):
                continue
            if fam.type == "counter":
                total = sum(s.value for s in fam.samples if s.name in (name, name + "_total"))
                counters[name] = counters.get(name, 0.0) + total
            elif fam.type == "gauge":
                gauges.setdefault(name, []).extend(s.value for s in fam.samples)
            elif fam.type == "histogram":
                acc = hists.setdefault(name, [0.0, 0.0])
                for s in fam.samples:
                    if s.name == name + "_sum":
                        acc[0] += s.value
                    elif s.name == name + "_count":
                        acc[1] += s.value
    except ValueError as exc:
        raise LoadgenError(f"/metrics is not Prometheus text: {exc}") from exc
    return ServerSnapshot(
        taken_at=taken_at,
        counters=counters,
        gauges={
            k: (sum(v) / len(v) if k.endswith("_perc") else sum(v)) for k, v in gauges.items() if v
        },
        histograms={k: (v[0], v[1]) for k, v in hists.items()},
    )


def _get_metrics(url: str, timeout_s: float) -> tuple[float, str]:
    try:
        resp = _http.get(url, timeout_s=timeout_s)
    except _http.HttpError as exc:
        raise LoadgenError(f"GET {url} failed: {exc}") from exc
    if resp.status != 200:
        raise LoadgenError(f"GET {url} answered HTTP {resp.status}; is it a vLLM server?")
    return resp.taken_at, resp.text


async def fetch_metrics_text(base_url: str, *, timeout_s: float = 10.0) -> tuple[float, str]:
    """GET ``{base_url}/metrics``: (time.time() of the answer, its text).

    Raises :class:`LoadgenError` when the server cannot be reached or answers non-200.
    """
    url = base_url.rstrip("/") + "/metrics"
    return await asyncio.to_thread(_get_metrics, url, timeout_s)


async def scrape_metrics(base_url: str, *, timeout_s: float = 10.0) -> ServerSnapshot:
    """Fetch ``{base_url}/metrics`` and parse it. Raises :class:`LoadgenError` on failure."""
    taken_at, text = await fetch_metrics_text(base_url, timeout_s=timeout_s)
    return parse_metrics(text, taken_at=taken_at)


def snapshot_metrics(base_url: str, *, timeout_s: float = 10.0) -> ServerSnapshot:
    """Synchronous :func:`scrape_metrics`, from a thread without a running event loop (it
    would block the loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise LoadgenError("snapshot_metrics() was called inside a running event loop; use "
                           "'await scrape_metrics(...)'")
    taken_at, text = _get_metrics(base_url.rstrip("/") + "/metrics", timeout_s)
    return parse_metrics(text, taken_at=taken_at)
