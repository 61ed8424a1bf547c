"""The fused-MoE problem a model poses, and the file name vLLM looks its kernel config up by.

vLLM's Triton fused-MoE kernel reads its tile sizes from a JSON file named
``E={E},N={N},device_name={GPU}[,dtype={dtype}][,block_shape=[n,k]].json``
(``vllm/model_executor/layers/fused_moe/fused_moe.py``: ``get_config_file_name`` and
``get_moe_configs``, vLLM 0.26 to 0.32 alike). ``N`` is ``w2.shape[2]``: the expert's
intermediate size on one tensor-parallel rank, the same for gated (SiLU: ``w13`` has 2N
rows) and non-gated experts (Nemotron-H's relu2: ``w13`` has N rows). The stand-in
Nemotron-3-Nano-30B-A3B gives ``E=128,N=1856`` on one GPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from autotune.errors import ConfigError

__all__ = ["MoeShape", "config_file_name", "device_file_name", "moe_shape_from_model"]

# config.json keys, most specific first (DeepSeek/Nemotron-H, Qwen-MoE, Mixtral, DBRX-like)
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")
_INTER_KEYS = ("moe_intermediate_size", "intermediate_size")
# non-gated expert MLPs: vLLM runs them with the ``*_no_mul`` activations (w13 has N rows)
_NON_GATED = {"relu2", "relu2_no_mul"}
_TORCH_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
                 "fp16": "float16", "half": "float16", "float32": "float32",
                 "float": "float32"}  # fmt: skip


@dataclass(frozen=True)
class MoeShape:
    """One fused-MoE layer as the kernel sees it (per tensor-parallel rank).

    ``experts`` (E), ``intermediate`` (N, per rank), ``hidden`` (K of the first GEMM),
    ``topk``, ``gated`` (w13 holds gate and up: 2N rows), ``torch_dtype`` of the
    activations and weights, ``config_dtype`` the file-name selector vLLM uses (None for
    bf16/fp16, "float32", "fp8_w8a8", ...) and ``block_shape`` for block-quantized weights.
    """

    experts: int
    intermediate: int
    hidden: int
    topk: int
    gated: bool = True
    torch_dtype: str = "bfloat16"
    config_dtype: str | None = None
    block_shape: tuple[int, int] | None = None

    @property
    def w13_rows(self) -> int:
        return 2 * self.intermediate if self.gated else self.intermediate

    @property
    def activation(self) -> str:
        """vLLM's ``MoEActivation`` value for this layer."""
        return "silu" if self.gated else "relu2_no_mul"

    def key(self) -> str:
        """E,N,dtype: what a tuned file is specific to (the GPU aside)."""
        parts = [f"E={self.experts}", f"N={self.intermediate}", f"K={self.hidden}",
                 f"topk={self.topk}", self.torch_dtype]
        if self.config_dtype:
            parts.append(self.config_dtype)
        return ",".join(parts)


def _first(cfg: Mapping[str, object], keys: tuple[str, ...]) -> object:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            return v
    return None


def _positive(value: object, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: {what} is {value!r}; a MoE model needs a positive integer")
    return value


def moe_shape_from_model(model: str | Path, *, tp: int = 1) -> MoeShape:
    """Read E, N, K, top-k, activation and dtype from ``model/config.json``.

    Raises :class:`ConfigError` when the model has no routed experts (a dense model has no
    fused-MoE kernel to tune) or when ``tp`` does not divide the expert width.
    """
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: --model must be a local model directory "
                          "with a config.json") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read as JSON: {exc}") from exc
    cfg = {**raw, **(raw.get("text_config") or {})}
    experts = _first(cfg, _EXPERT_KEYS)
    if not experts:
        raise ConfigError(
            f"{path}: no routed experts ({'/'.join(_EXPERT_KEYS)} missing or 0): a dense "
            "model has no fused-MoE kernel to tune")
    experts = _positive(experts, "the number of experts", str(path))
    topk = _positive(_first(cfg, _TOPK_KEYS), "top-k (num_experts_per_tok)", str(path))
    inter = _positive(_first(cfg, _INTER_KEYS), "moe_intermediate_size", str(path))
    hidden = _positive(cfg.get("hidden_size"), "hidden_size", str(path))
    if tp < 1 or inter % tp:
        raise ConfigError(f"--tp {tp} does not divide the expert width {inter} ({path})")
    act = str(cfg.get("mlp_hidden_act") or cfg.get("hidden_act") or "silu").lower()
    gated = act not in _NON_GATED
    raw_dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").lower()
    torch_dtype = _TORCH_DTYPES.get(raw_dtype.removeprefix("torch."), "bfloat16")
    config_dtype: str | None = "float32" if torch_dtype == "float32" else None
    block: tuple[int, int] | None = None
    quant = cfg.get("quantization_config") or {}
    if quant:
        method = str(quant.get("quant_method", "")).lower()
        if method != "fp8":
            raise ConfigError(
                f"{path}: quantization {method or '?'} is not supported by 'autotune kernels "
                "moe' (unquantized and FP8 checkpoints only)")
        config_dtype = "fp8_w8a8"
        wbs = quant.get("weight_block_size")
        if isinstance(wbs, list) and len(wbs) == 2 and all(isinstance(x, int) for x in wbs):
            block = (int(wbs[0]), int(wbs[1]))
    return MoeShape(experts=experts, intermediate=inter // tp, hidden=hidden, topk=topk,
                    gated=gated, torch_dtype=torch_dtype, config_dtype=config_dtype,
                    block_shape=block)


def device_file_name(gpu_name: str) -> str:
    """The GPU's name as vLLM writes it in config file names ("NVIDIA H200" ->
    "NVIDIA_H200"; every H200 variant, e.g. "NVIDIA H200 NVL", maps to "NVIDIA_H200")."""
    name = re.sub(r"[\s/]+", "_", gpu_name.strip())
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def config_file_name(shape: MoeShape, gpu_name: str) -> str:
    """The file vLLM's ``get_moe_configs`` opens for ``shape`` on ``gpu_name``."""
    dtype = f",dtype={shape.config_dtype}" if shape.config_dtype else ""
    block = (f",block_shape=[{shape.block_shape[0]},{shape.block_shape[1]}]"
             if shape.block_shape and all(shape.block_shape) else "")
    return (f"E={shape.experts},N={shape.intermediate},"
            f"device_name={device_file_name(gpu_name)}{dtype}{block}.json")
