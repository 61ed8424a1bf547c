"""Summaries of a sample: the rounding every shape statistic goes through and the
101-quantile length distribution."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from autotune.traffic._models import N_QUANTILES, LengthDist

__all__ = ["PROBS", "from_quantiles", "length_dist", "rounded"]

PROBS: Final = np.linspace(0.0, 1.0, N_QUANTILES)


def rounded(x: float) -> float:
    """6 significant digits: stable in JSON and far below any statistical noise."""
    x = float(x)
    return 0.0 if x == 0 else float(f"{x:.6g}")


def from_quantiles(q: npt.ArrayLike, *, mean: float, std: float) -> LengthDist:
    """A :class:`LengthDist` from its 101 quantiles and moments (all rounded)."""
    qs = [rounded(v) for v in np.asarray(q, dtype=np.float64)]
    return LengthDist(
        mean=rounded(mean),
        std=rounded(std),
        min=qs[0],
        p50=qs[50],
        p90=qs[90],
        p99=qs[99],
        max=qs[100],
        quantiles=qs,
    )


def length_dist(values: npt.ArrayLike) -> LengthDist:
    """Summary and 101 quantiles of a non-empty array of lengths."""
    a = np.asarray(values, dtype=np.float64)
    return from_quantiles(np.quantile(a, PROBS), mean=float(a.mean()), std=float(a.std()))
