"""Facts about the model and the machine that a search space's conditions read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from autotune.errors import SpaceError
from autotune.hardware import cpu_has_avx512

_FACTS = ("device", "hybrid", "mtp", "moe", "gpu_arch", "avx512", "real_weights", "streams",
          "prompt_p90", "gpus", "weights_dtype", "prequantized")
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def _has_routed_experts(cfg: Mapping[str, Any]) -> bool:
    """A MoE model: config.json (or its text_config) names routed experts."""
    text = {**cfg, **(cfg.get("text_config") or {})}
    return any(int(text.get(k) or 0) > 0 for k in _EXPERT_KEYS)


_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


class ModelFacts(BaseModel):
    """What the space's conditions may ask about the model and the machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Literal["cpu", "cuda"] = "cpu"
    hybrid: bool = False
    mtp: bool = False
    moe: bool = False  # routed experts (vLLM's fused-MoE kernel runs)
    gpu_arch: str = ""
    avx512: bool = False  # the CPU build needs AVX-512 (or AMX) for FP8 KV caches
    # a real checkpoint: weight files, and not one of autotune's generated tiny models.
    # Without it the space's `stand_in` part applies (dummy weights, synthetic acceptance).
    real_weights: bool = False
    # config.json's dtype ("torch_dtype", or "dtype" in newer checkpoints), and whether the
    # checkpoint is already quantized (a "quantization_config"): vLLM quantizes a 16-bit
    # checkpoint online (--quantization fp8), and rejects a --quantization that differs from
    # the method a quantized checkpoint names.
    weights_dtype: str = ""
    prequantized: bool = False
    # the traffic the study replays (0 when unknown, e.g. a space loaded without a shape):
    # concurrent streams (--concurrency, the closed loop's, or an open loop's estimate) and
    # the 90th-percentile prompt.
    # A step of that traffic holds up to streams x (1 + MTP depth) decode tokens plus a
    # prompt chunk, which is what CUDA-graph capture sizes must cover (issue 14's H200 runs).
    streams: int = 0
    prompt_p90: int = 0
    # GPUs of the largest node the trials run on (0: none, e.g. the CPU build): the
    # parallelism knobs exist only where a server can have more than one
    gpus: int = 0

    def with_traffic(self, *, streams: int, prompt_p90: float) -> ModelFacts:
        """These facts plus the traffic's (see ``autotune.kernels.streams_of``)."""
        return self.model_copy(update={"streams": int(streams), "prompt_p90": int(prompt_p90)})

    @classmethod
    def from_model_dir(cls, model: str | Path, *, device: str, gpu_arch: str = "",
                       gpus: int = 0) -> ModelFacts:
        cfg_path = Path(model) / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise SpaceError(
                f"{cfg_path} not found: --model must be a local model directory with a "
                "config.json (make one with 'autotune model tiny DIR')"
            ) from None
        except (OSError, json.JSONDecodeError) as exc:
            raise SpaceError(f"{cfg_path} cannot be read as JSON: {exc}") from exc
        model_type = str(cfg.get("model_type", ""))
        pattern = str(cfg.get("hybrid_override_pattern", ""))
        hybrid = "M" in pattern or model_type in {"nemotron_h", "mamba2", "bamba", "jamba",
                                                  "falcon_h1", "granitemoehybrid", "qwen3_next"}
        mtp = int(cfg.get("num_nextn_predict_layers", 0) or 0) > 0
        moe = _has_routed_experts(cfg)
        text = {**cfg, **(cfg.get("text_config") or {})}
        dtype = str(text.get("torch_dtype") or text.get("dtype") or "")
        prequantized = bool(text.get("quantization_config"))
        d = Path(model)
        real = not (d / "autotune-model.json").exists() and any(
            next(d.glob(g), None) is not None for g in _WEIGHTS
        )
        return cls(device=device, hybrid=hybrid, mtp=mtp, moe=moe,  # type: ignore[arg-type]
                   gpu_arch=gpu_arch, avx512=cpu_has_avx512(), real_weights=real, gpus=gpus,
                   weights_dtype=dtype, prequantized=prequantized)
