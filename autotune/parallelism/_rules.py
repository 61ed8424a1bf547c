"""The rules vLLM applies to a parallel config, checked before any server starts.

* tensor parallelism splits attention heads evenly: TP must divide the attention heads
  and the Mamba heads; KV heads are split evenly, or replicated when TP exceeds them (one
  of TP and the KV heads divides the other);
* expert parallelism exists only for models with routed experts;
* a server's ranks (TP x PP x DP) run on one node: no more than its GPUs;
* weights plus the smallest KV cache vLLM accepts (one ``--max-model-len`` sequence) must
  fit ``--gpu-memory-utilization`` of each GPU (an estimate from ``config.json``,
  :mod:`autotune.parallelism._model`; only where a GPU's memory is known).

A broken rule is one line naming the figures, so that the rejected trial says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from autotune.parallelism._count import flag_value as _flag
from autotune.parallelism._count import parallel_sizes
from autotune.parallelism._model import ModelSize, dtype_bytes
from autotune.parallelism._pool import Node

__all__ = ["MemoryEstimate", "ParallelRules"]

_GIB = 1024**3
_VLLM_MEMORY_SHARE = 0.9  # vLLM's --gpu-memory-utilization default


class HasFlags(Protocol):
    """What a check reads of a launch (``autotune.space.LaunchSpec``): its engine flags."""

    @property
    def flags(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU of a server needs at least, and what it has."""

    weights: float
    kv: float
    budget: float | None  # --gpu-memory-utilization x the GPU's memory; None when unknown
    share: float
    tokens: int

    @property
    def fits(self) -> bool:
        return self.budget is None or self.weights + self.kv <= self.budget


@dataclass(frozen=True)
class ParallelRules:
    """The rules for one model on one kind of node (``node`` None: no node limits)."""

    size: ModelSize
    node: Node | None = None

    def memory(self, flags: Sequence[str]) -> MemoryEstimate:
        """The weights and minimum KV cache one GPU holds under ``flags``."""
        s, z = parallel_sizes(flags), self.size
        tp, pp = int(s["tensor"]), int(s["pipeline"])
        wb = 1 if (_flag(flags, "--quantization") or "").startswith("fp8") else (
            z.weight_bytes_per_param)
        ep_ranks = tp * int(s["data"]) if s["expert"] else tp
        weights = (z.other_params / tp + z.expert_params / ep_ranks) * wb / pp
        kv_dtype = _flag(flags, "--kv-cache-dtype") or "auto"
        kvb = z.dtype_bytes if kv_dtype == "auto" else dtype_bytes(kv_dtype, z.dtype_bytes)
        per_token = z.kv_per_token * kvb / (1 if z.mla else min(tp, max(1, z.kv_heads)))
        try:
            tokens = int(_flag(flags, "--max-model-len") or z.max_len)
        except ValueError:
            tokens = z.max_len
        ssm = _flag(flags, "--mamba-ssm-cache-dtype")
        state = z.mamba_state_bytes * (dtype_bytes(ssm, 4) / 4 if ssm else 1.0) / tp
        kv = (tokens * per_token + state) / pp
        try:
            share = float(_flag(flags, "--gpu-memory-utilization") or _VLLM_MEMORY_SHARE)
        except ValueError:
            share = _VLLM_MEMORY_SHARE
        mem = self.node.gpu_memory_gib if self.node is not None else None
        return MemoryEstimate(weights=weights, kv=kv, share=share, tokens=tokens,
                              budget=share * mem * _GIB if mem else None)

    def __call__(self, params: Mapping[str, object], launch: HasFlags) -> list[str]:
        """A search space's check (``SearchSpace.with_checks``): the launch's flags."""
        return self.check(params, launch.flags)

    def check(self, params: Mapping[str, object], flags: Sequence[str]) -> list[str]:
        """Why vLLM would refuse (or could not fit) a server with ``flags``; [] when none."""
        s, z = parallel_sizes(flags), self.size
        tp, pp, dp = int(s["tensor"]), int(s["pipeline"]), int(s["data"])
        out: list[str] = []
        if z.attention_heads % tp:
            out.append(f"tensor parallel size {tp} does not divide the model's "
                       f"{z.attention_heads} attention heads (config.json): vLLM refuses it")
        if z.kv_heads and z.kv_heads % tp and tp % z.kv_heads:
            out.append(f"tensor parallel size {tp} neither divides the model's {z.kv_heads} "
                       "KV heads nor is a multiple of them (vLLM splits or replicates them)")
        if z.mamba_heads and z.mamba_heads % tp:
            out.append(f"tensor parallel size {tp} does not divide the model's "
                       f"{z.mamba_heads} Mamba heads (config.json mamba_num_heads)")
        if s["expert"] and not z.moe:
            out.append("expert parallelism needs a mixture-of-experts model; config.json "
                       "names no routed experts")
        n = tp * pp * dp
        if self.node is not None and n > self.node.gpus:
            out.append(f"TP {tp} x DP {dp}" + (f" x PP {pp}" if pp > 1 else "")
                       + f" = {n} GPUs for one server, but a node has {self.node.gpus}: "
                       "lower the parallel sizes, or add a node with more GPUs")
        mem = self.memory(flags)
        if not mem.fits and mem.budget is not None:
            gib = self.node.gpu_memory_gib if self.node else 0.0
            out.append(
                f"estimated from config.json: weights {mem.weights / _GIB:.1f} GiB + the "
                f"smallest KV cache {mem.kv / _GIB:.2f} GiB ({mem.tokens} tokens) per GPU at "
                f"TP {tp}" + (" with expert parallelism" if s["expert"] else "")
                + f" exceed {mem.budget / _GIB:.1f} GiB ({mem.share:g} of {gib:g} GiB; "
                f"{self.size.params / 1e9:.2f} B parameters): raise the tensor parallel "
                "size or lower --max-model-len")
        return out
