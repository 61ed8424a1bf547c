"""PNG plots of a traffic shape (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from autotune.errors import ShapeError
from autotune.traffic._models import LengthDist, TrafficShape

__all__ = ["write_plots"]

_SAMPLE = 20_000


def _hist(ax: object, dist: LengthDist, label: str) -> None:
    # the shape keeps quantiles, not records: histogram a deterministic draw from them
    u = (np.arange(_SAMPLE) + 0.5) / _SAMPLE
    values = np.interp(u * 100, np.arange(101), dist.quantiles)
    lo, hi = max(dist.min, 1.0), max(dist.max, 2.0)
    log = hi / lo > 50
    bins = np.geomspace(lo, hi, 60) if log else np.linspace(dist.min, hi, 60)
    ax.hist(values, bins=bins, color="tab:blue", alpha=0.8)  # type: ignore[attr-defined]
    if log:
        ax.set_xscale("log")  # type: ignore[attr-defined]
    for q, style in ((dist.p50, "--"), (dist.p99, ":")):
        ax.axvline(q, color="k", linestyle=style, linewidth=1)  # type: ignore[attr-defined]
    ax.set_xlabel(f"{label} tokens (dashed p50 = {dist.p50:g}, dotted p99 = {dist.p99:g})")  # type: ignore[attr-defined]
    ax.set_ylabel("requests (share of 20k draws)")  # type: ignore[attr-defined]


def write_plots(shape: TrafficShape, out_dir: str | Path) -> list[Path]:
    """Write input/output length histograms and, when known, the arrival rate over time.

    Returns the PNG paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ShapeError(f"cannot create the plot folder {out}: {exc}") from exc
    written: list[Path] = []
    for key, label in (("input_tokens", "input"), ("output_tokens", "output")):
        fig, ax = plt.subplots(figsize=(7, 4))
        _hist(ax, getattr(shape, key), label)
        ax.set_title(f"{shape.name}: {label} lengths ({shape.requests} requests)")
        fig.tight_layout()
        path = out / f"{shape.name}-{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    a = shape.arrivals
    if a is not None and a.rate_profile:
        fig, ax = plt.subplots(figsize=(7, 4))
        t = np.arange(len(a.rate_profile)) * a.window_s / 60.0
        ax.step(t, a.rate_profile, where="post", color="tab:orange")
        ax.axhline(
            shape.rate_rps,
            color="k",
            linestyle="--",
            linewidth=1,
            label=f"mean {shape.rate_rps:.3g} req/s",
        )
        ax.set_xlabel(f"minutes from the first request ({a.window_s:g} s windows)")
        ax.set_ylabel("arrival rate (req/s)")
        ax.set_title(f"{shape.name}: arrivals (dispersion per 60 s = {a.dispersion_60s})")
        ax.legend()
        fig.tight_layout()
        path = out / f"{shape.name}-arrival_rate.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
