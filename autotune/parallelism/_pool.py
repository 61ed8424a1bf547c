"""Which GPUs of which node a trial gets: a first-fit pool the executors share.

A trial's server needs ``n`` GPUs of one node (its ranks talk over the node's links). The
pool hands out whole GPUs, never one to two trials, and prefers the node with the fewest
free GPUs that still fits (best fit), so that large holes stay free for large trials.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.errors import AutotuneError

__all__ = ["GpuPool", "Node"]


@dataclass(frozen=True)
class Node:
    """What the parallelism rules know of the machines: the GPUs of the largest node and,
    when known, one GPU's memory."""

    gpus: int
    gpu_memory_gib: float | None = None


class GpuPool:
    """Free and taken GPUs per node. ``nodes``: node id -> its GPU ids."""

    def __init__(self, nodes: dict[str, list[int]]) -> None:
        self.nodes = {k: list(v) for k, v in nodes.items() if v}
        self._free = {k: sorted(v) for k, v in self.nodes.items()}

    @classmethod
    def single(cls, gpus: int, node: str = "node0") -> GpuPool:
        return cls({node: list(range(gpus))})

    @property
    def total(self) -> int:
        return sum(len(v) for v in self.nodes.values())

    @property
    def largest_node(self) -> int:
        return max((len(v) for v in self.nodes.values()), default=0)

    def free(self) -> int:
        return sum(len(v) for v in self._free.values())

    def fits(self, n: int) -> bool:
        """Some node has ``n`` free GPUs now."""
        return any(len(v) >= max(1, n) for v in self._free.values())

    def take(self, n: int) -> tuple[str, tuple[int, ...]]:
        """``n`` free GPUs of one node (best fit); AutotuneError when none has them."""
        n = max(1, n)
        fitting = [(len(v), k) for k, v in self._free.items() if len(v) >= n]
        if not fitting:
            raise AutotuneError(f"no node has {n} free GPU(s) (free: {self.describe()})")
        _, node = min(fitting)
        ids, self._free[node] = tuple(self._free[node][:n]), self._free[node][n:]
        return node, ids

    def release(self, node: str, ids: tuple[int, ...]) -> None:
        free = self._free[node]
        if set(ids) & set(free) or not set(ids) <= set(self.nodes[node]):
            raise AutotuneError(f"GPUs {ids} of {node} were not taken")
        self._free[node] = sorted(free + list(ids))

    def describe(self) -> str:
        return ", ".join(f"{k}: {len(v)}/{len(self.nodes[k])}" for k, v in self._free.items())
