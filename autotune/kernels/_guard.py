"""Guard keys: vLLM's own default config written at token counts the tuning did not time.

vLLM serves a token count M with the nearest key of the tuned file
(``min(keys, key=lambda k: abs(k - M))``), however far that key is. A file holding only the
traffic's counts hands their tiles to every other M: measured on an H200 (vLLM 0.26,
E=128,N=1856), M=1 ran the key-32 config at 0.947x the default's speed and M=4608 the
key-1024 one (BLOCK_SIZE_M 64, 4 warps) at 0.877x. Guard keys hold vLLM's default config
(:func:`~autotune.kernels._space.default_config`) at

* both ends of every run of M over which the default config is constant (its thresholds
  are found by scanning :func:`default_config`, so they follow it when it changes), and
* a geometric grid like vLLM's ``benchmark_moe.py`` batch sizes (1, 2, 4, ..., 4096, then
  x1.5 / x4/3 steps: 6144, 8192, 12288, ...) up to at least the largest count served,

so that an M is served by a tuned config only when a tuned key is its nearest one, and by
its own default config otherwise: between two guard keys of one constant run both hold
M's default. A tuned count always keeps its key (a guard never replaces it).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from autotune.kernels._moe_shape import MoeShape
from autotune.kernels._space import KernelConfig, default_config

__all__ = ["default_boundaries", "guard_grid", "guard_keys", "with_guard_keys"]

#: vLLM's benchmark_moe.py batch sizes (``--batch-size`` default list)
_BENCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072,
                4096)


def guard_grid(limit: int) -> list[int]:
    """vLLM's benchmark batch sizes, continued by alternating x1.5 and x4/3 steps (6144,
    8192, 12288, 16384, ...) up to the first size at or above ``limit``."""
    sizes = list(_BENCH_SIZES)
    while sizes[-1] < limit:
        last = sizes[-1]
        sizes.append(last * 3 // 2 if last & (last - 1) == 0 else last * 4 // 3)
    return [m for i, m in enumerate(sizes) if i == 0 or sizes[i - 1] < limit]


def default_boundaries(shape: MoeShape, limit: int) -> list[int]:
    """Both ends of every run of token counts ``1..limit`` over which vLLM's default config
    is the same (``1``, ``limit`` and each ``m - 1, m`` where it changes at ``m``)."""
    if limit < 1:
        return []
    ends = {1, limit}
    before = default_config(1, shape)
    for m in range(2, limit + 1):
        now = default_config(m, shape)
        if now != before:
            ends.update((m - 1, m))
            before = now
    return sorted(ends)


def guard_keys(shape: MoeShape, *, limit: int, tuned: Collection[int] = ()
               ) -> dict[int, KernelConfig]:
    """Guard key -> vLLM's default config there, for every M up to ``limit`` (the grid
    continues to its first size at or above it); the counts in ``tuned`` are left out."""
    top = guard_grid(max(1, limit))[-1]
    keys = set(guard_grid(top)) | set(default_boundaries(shape, top))
    return {m: default_config(m, shape) for m in sorted(keys) if m not in tuned}


def with_guard_keys(configs: Mapping[int, KernelConfig], shape: MoeShape, *, limit: int = 0
                    ) -> tuple[dict[int, KernelConfig], list[int]]:
    """The file's content: ``configs`` (the tuned counts, which always keep their key) plus
    the guard keys up to ``max(limit, largest count)``; and the guard keys added."""
    top = max([limit, *configs])
    guards = guard_keys(shape, limit=top, tuned=set(configs))
    return {**guards, **configs}, sorted(guards)
