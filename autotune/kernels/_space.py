"""The fused-MoE Triton kernel's config space, and the rules that prune it before timing.

The grid is vLLM's own (``benchmarks/kernels/benchmark_moe.py``,
``get_configs_compute_bound``): BLOCK_SIZE_M 16-256, BLOCK_SIZE_N 32-256, BLOCK_SIZE_K
64-256, GROUP_SIZE_M 1-64, num_warps 4/8, num_stages 2-5: 1,920 points, each a Triton
compile (seconds) and a timing. Optuna samples it instead of walking it; these rules drop,
without a GPU, what cannot run or cannot differ:

* **shared memory**: the kernel's pipeline holds ``num_stages`` tiles of A (M x K) and B
  (K x N); above the GPU's shared memory per block (227 KiB on Hopper) Triton raises
  OutOfResources at launch;
* **block quantization**: with FP8 block-quantized weights BLOCK_SIZE_K and BLOCK_SIZE_N
  must be multiples of the quantization block (as vLLM's benchmark filters);
* **tile taller than the batch**: BLOCK_SIZE_M above the next power of two of the routed
  tokens (M x top-k, at least 16) is pure padding;
* **equivalent group sizes**: the kernel uses ``min(GROUP_SIZE_M, blocks left)``, so every
  GROUP_SIZE_M at or above the number of M blocks behaves the same: only the smallest of
  them is kept (the others map to it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from autotune.kernels._moe_shape import MoeShape

__all__ = ["GRID", "KEYS", "KernelConfig", "as_params", "canonical", "default_config", "grid",
           "prune_reason", "smem_bytes"]

KernelConfig = dict[str, int]

#: vLLM's tuning grid (benchmark_moe.py, get_configs_compute_bound, CUDA)
GRID: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}
KEYS = tuple(GRID)
#: shared memory per block an H100/H200 kernel may use (sm90: 227 KiB)
HOPPER_SMEM = 232_448
_ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def grid() -> list[KernelConfig]:
    """Every point of the grid, in vLLM's order."""
    return [dict(zip(KEYS, values, strict=True)) for values in itertools.product(*GRID.values())]


def smem_bytes(config: Mapping[str, int], shape: MoeShape) -> int:
    """Shared memory the kernel's software pipeline needs (A and B tiles per stage)."""
    elem = 1 if shape.config_dtype == "fp8_w8a8" else _ELEM_BYTES.get(shape.torch_dtype, 2)
    tiles = (config["BLOCK_SIZE_M"] * config["BLOCK_SIZE_K"]
             + config["BLOCK_SIZE_K"] * config["BLOCK_SIZE_N"])
    return config["num_stages"] * tiles * elem


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _m_blocks(m: int, shape: MoeShape, block_m: int) -> int:
    """An upper bound of the kernel's M blocks (vLLM's padded sorted-token length / BLOCK_M)."""
    routed = m * shape.topk
    padded = routed + shape.experts * (block_m - 1)
    if routed < shape.experts:
        padded = min(padded, routed * block_m)
    return max(1, -(-padded // block_m))


def prune_reason(config: Mapping[str, int], m: int, shape: MoeShape,
                 smem_limit: int = HOPPER_SMEM) -> str | None:
    """Why ``config`` need not be timed at ``m`` tokens (None: time it)."""
    need = smem_bytes(config, shape)
    if need > smem_limit:
        return f"shared memory: {need} bytes > {smem_limit}"
    if shape.block_shape is not None:
        bn, bk = shape.block_shape
        if config["BLOCK_SIZE_K"] % bk or config["BLOCK_SIZE_N"] % bn:
            return f"block quantization [{bn},{bk}] needs BLOCK_SIZE_N/K multiples of it"
    tallest = max(16, _next_pow2(m * shape.topk))
    if config["BLOCK_SIZE_M"] > tallest:
        return f"BLOCK_SIZE_M {config['BLOCK_SIZE_M']} > {tallest} routed tokens (padding)"
    return None


def canonical(config: Mapping[str, int], m: int, shape: MoeShape) -> KernelConfig:
    """The config that runs exactly like ``config`` at ``m`` tokens (smallest equivalent
    GROUP_SIZE_M): equal canonical forms need one timing."""
    out = {k: int(config[k]) for k in KEYS}
    blocks = _m_blocks(m, shape, out["BLOCK_SIZE_M"])
    groups = sorted(GRID["GROUP_SIZE_M"])
    if out["GROUP_SIZE_M"] >= blocks:
        out["GROUP_SIZE_M"] = min(g for g in groups if g >= blocks)
    return out


def default_config(m: int, shape: MoeShape) -> KernelConfig:
    """vLLM 0.26's own choice when no file exists (``get_default_config``, the bf16/fp16
    and per-tensor FP8 branch on CUDA): the baseline every search starts from."""
    block_m = 16 if m <= 32 else 32 if m <= 96 else 64 if m <= 512 else 128
    return {
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": 64 if m <= 64 else 128,
        "BLOCK_SIZE_K": 128 if shape.config_dtype == "fp8_w8a8" or m <= 64 else 64,
        "GROUP_SIZE_M": 16 if m // max(shape.experts, 1) > 128 else 1,
        "num_warps": 4 if m <= 128 else 8,
        "num_stages": 4 if m <= 32 else 3,
    }


def as_params(config: Mapping[str, int]) -> KernelConfig:
    """Only the six tunables, as ints (what the JSON file stores per key)."""
    return {k: int(config[k]) for k in KEYS}
