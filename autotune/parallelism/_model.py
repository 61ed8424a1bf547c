"""What the parallelism rules read from a model's ``config.json``: head counts, experts,
and an estimate of its weights and of the smallest KV cache vLLM accepts.

The estimate counts the parameters of the layers the config describes (embeddings,
attention, dense or expert MLPs, Mamba mixers; norms and biases left out, so it is a
little low) at the checkpoint's dtype (a ``quantization_config`` or ``--quantization
fp8`` stores a byte per weight). It stands in for the weight files, which a stand-in model
does not have. vLLM refuses to start when the KV cache cannot hold one sequence of
``--max-model-len`` tokens: that sequence (plus one Mamba state per sequence for hybrid
models) is the minimum counted here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import SpaceError

__all__ = ["ModelSize", "dtype_bytes"]

_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "float16": 2, "half": 2, "fp16": 2,
                "bfloat16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
                "float8_e4m3fn": 1, "int8": 1}


def dtype_bytes(name: str | None, default: int = 2) -> int:
    """Bytes per element of a dtype name ("bfloat16" 2, "fp8" 1); ``default`` if unknown."""
    return _DTYPE_BYTES.get(str(name or "").lower().removeprefix("torch."), default)


def _int(cfg: Mapping[str, object], *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return int(v)
    return default


@dataclass(frozen=True)
class ModelSize:
    """The figures of one model the parallelism rules need (see the module docstring)."""

    attention_heads: int
    kv_heads: int
    mamba_heads: int  # 0 without Mamba layers
    experts: int  # routed experts; 0 for a dense model
    expert_params: int  # parameters in routed experts (split by expert parallelism)
    other_params: int  # every other parameter (split by tensor parallelism)
    weight_bytes_per_param: int
    kv_per_token: int  # KV-cache elements per token: every attention layer, all KV heads
    mla: bool  # a latent (MLA) cache: one shared entry per layer, not split by TP
    dtype_bytes: int  # the model's activation dtype (the KV cache's unless --kv-cache-dtype)
    mamba_state_bytes: int  # per sequence, all Mamba layers, float32 SSM state
    max_len: int  # max_position_embeddings

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def params(self) -> int:
        return self.expert_params + self.other_params

    @classmethod
    def from_model_dir(cls, model: str | Path) -> ModelSize:
        path = Path(model) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SpaceError(f"{path} cannot be read as JSON ({exc}); the parallelism "
                             "rules read the model's heads and size from it") from exc
        return cls.from_config(cfg)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> ModelSize:
        cfg = {**raw, **(raw.get("text_config") or {})}
        h = _int(cfg, "hidden_size", "d_model")
        layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _int(cfg, "num_attention_heads", "n_head", default=1)
        kv = _int(cfg, "num_key_value_heads", "num_kv_heads", default=heads)
        hd = _int(cfg, "head_dim", "attention_head_dim", default=h // heads if heads else 0)
        vocab = _int(cfg, "vocab_size")
        inter = _int(cfg, "intermediate_size", "ffn_hidden_size")
        experts = max((_int(cfg, k) for k in _EXPERT_KEYS), default=0)
        moe_inter = _int(cfg, "moe_intermediate_size", "expert_intermediate_size", default=inter)
        shared_inter = _int(cfg, "moe_shared_expert_intermediate_size",
                            "shared_expert_intermediate_size",
                            default=moe_inter * _int(cfg, "n_shared_experts",
                                                     "num_shared_experts"))
        # relu2 MLPs (Nemotron) have an up and a down matrix; gated ones (SwiGLU) three
        mats = 2 if str(cfg.get("mlp_hidden_act", cfg.get("hidden_act", ""))) == "relu2" else 3
        m_heads = _int(cfg, "mamba_num_heads")
        m_hd = _int(cfg, "mamba_head_dim", default=64)
        groups = _int(cfg, "n_groups", "mamba_n_groups", default=1)
        state = _int(cfg, "ssm_state_size", "mamba_d_state", default=128)
        conv = _int(cfg, "conv_kernel", "mamba_d_conv", default=4)
        pattern = str(cfg.get("hybrid_override_pattern") or "")
        if pattern:  # Nemotron-H: one char per layer
            n_attn, n_mamba = pattern.count("*"), pattern.count("M")
            n_mlp, n_moe = pattern.count("-"), pattern.count("E")
        else:
            dense_first = min(layers, _int(cfg, "first_k_dense_replace")) if experts else layers
            n_attn, n_mamba = layers, 0
            n_moe = layers - dense_first if experts else 0
            n_mlp = layers - n_moe
        mla = _int(cfg, "kv_lora_rank")
        attn = h * heads * hd * 2 + 2 * h * kv * hd
        d_inner = m_heads * m_hd
        mamba = (h * (2 * d_inner + 2 * groups * state + m_heads) + d_inner * h
                 + (d_inner + 2 * groups * state) * conv)
        tied = bool(cfg.get("tie_word_embeddings", False))
        expert_params = n_moe * experts * mats * h * moe_inter
        other = (vocab * h * (1 if tied else 2) + n_attn * attn + n_mamba * mamba
                 + n_mlp * mats * h * inter
                 + n_moe * (mats * h * shared_inter + h * experts))
        quant = cfg.get("quantization_config") or {}
        wbytes = 1 if quant else dtype_bytes(cfg.get("torch_dtype") or cfg.get("dtype"))
        kvb = dtype_bytes(cfg.get("torch_dtype") or cfg.get("dtype"))
        per_token = (n_attn * (mla + _int(cfg, "qk_rope_head_dim")) if mla
                     else n_attn * 2 * kv * hd)
        m_state = n_mamba * ((d_inner + 2 * groups * state) * (conv - 1) * kvb
                             + m_heads * m_hd * state * 4)
        return cls(attention_heads=heads, kv_heads=kv, mamba_heads=m_heads, experts=experts,
                   expert_params=expert_params, other_params=other, weight_bytes_per_param=wbytes,
                   kv_per_token=per_token, mla=bool(mla), dtype_bytes=kvb,
                   mamba_state_bytes=m_state,
                   max_len=_int(cfg, "max_position_embeddings", "max_seq_len", default=2048))
