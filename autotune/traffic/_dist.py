"""Summaries of a sample: the rounding every shape statistic goes through and the
101-quantile length distribution."""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from autotune.traffic._models import N_QUANTILES, LengthDist, PrefixStats
from autotune.traffic._records import PrefixInfo

__all__ = ["PROBS", "from_quantiles", "length_dist", "prefix_stats", "rounded"]

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


def prefix_stats(info: PrefixInfo, inp: npt.NDArray[np.int64]) -> PrefixStats:
    """The shape's prefix statistics of per-request sharing ``info`` over prompts of
    ``inp`` tokens (the same requests)."""
    sharing = info.shared_tokens > 0
    n_sharing = int(np.count_nonzero(sharing))
    groups = int(np.unique(info.group[sharing]).shape[0]) if n_sharing else 0
    ratio = None
    tokens = None
    if n_sharing:
        tokens = length_dist(info.shared_tokens[sharing])
        ratio = [rounded(v) for v in np.quantile(info.shared_tokens[sharing] / inp[sharing],
                                                 PROBS)]
    return PrefixStats(
        source=info.source,
        block_tokens=info.block_tokens,
        shared_token_fraction=rounded(min(1.0, float(info.hit_tokens.sum() / inp.sum()))),
        sharing_request_fraction=rounded(n_sharing / inp.shape[0]),
        groups=groups,
        mean_group_size=rounded(n_sharing / groups) if groups else 0.0,
        shared_prefix_tokens=tokens,
        shared_prefix_ratio=ratio,
    )
