"""Generate tiny models locally: config, tokenizer and random weights, no model hub.

The tokenizer is a WordLevel vocabulary whose token *i* is the string ``t{i}`` (ids 0-3 are
the special tokens ``<pad> <s> </s> <unk>``), so any list of ids >= 4 decodes to text that
re-encodes to exactly the same ids: prompts of exact token lengths work through both the
completions and the chat endpoints, and vLLM's own benchmark client works unchanged
against the same model directory. (Special tokens must not look like ``t<i>``: transformers
matches special tokens as substrings, so a special ``t1`` would split ``t11``.)

Two architectures:

* ``llama``: a plain transformer (``LlamaForCausalLM``).
* ``nemotron_h``: a real hybrid (``NemotronHForCausalLM``): Mamba2 layers, attention
  layers and MLP layers interleaved, optionally with one MTP layer for speculative decoding
  (``mtp=True``). The MTP block is ``*E`` by default (attention + MoE, like the real
  checkpoints; MoE fields are set too), or ``*`` (attention only): vLLM's CPU build cannot
  run NemotronH's non-gated MoE experts, but it serves an attention-only MTP block, so MTP
  depth can be searched on CPU (docs/cpu-vllm.md). transformers does not save MTP weights:
  serve MTP with ``--load-format dummy`` (``search_spaces/cpu.yaml`` derives it).

Weights are random but *peaked*: the output projection is scaled so that greedy decoding
is decisive rather than a coin toss between near-equal logits, which the quality probe
needs to tell numerical drift (e.g. FP16 Mamba state) from noise.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Literal

from autotune.errors import ModelGenError

__all__ = [
    "ARCHS",
    "TOKENIZERS",
    "generate_tiny_model",
    "tiny_config",
    "write_bpe_tokenizer",
    "write_tokenizer",
]

logger = logging.getLogger(__name__)

Arch = Literal["llama", "nemotron_h"]
ARCHS: tuple[str, ...] = ("llama", "nemotron_h")
TokenizerKind = Literal["words", "bpe"]
TOKENIZERS: tuple[str, ...] = ("words", "bpe")

_SPECIAL = {"pad_token": 0, "bos_token": 1, "eos_token": 2}
_SPECIAL_TEXT = {0: "<pad>", 1: "<s>", 2: "</s>", 3: "<unk>"}


MTP_PATTERNS: tuple[str, ...] = ("*E", "*")


_MAX_POSITIONS = 4096  # the context of every tiny model (its tokenizer's max_length too)


def tiny_config(arch: Arch, *, vocab_size: int = 4096, mtp: bool = False,
                mtp_pattern: str = "*E") -> dict[str, object]:
    """The ``config.json`` contents of a tiny model of ``arch`` (< 50 M parameters)."""
    if mtp_pattern not in MTP_PATTERNS:
        raise ModelGenError(
            f"MTP pattern {mtp_pattern!r} is unknown; use one of {', '.join(MTP_PATTERNS)}"
        )
    if vocab_size < 64:
        raise ModelGenError(f"vocab_size is {vocab_size}; use at least 64 tokens")
    common: dict[str, object] = {
        "vocab_size": vocab_size,
        "bos_token_id": _SPECIAL["bos_token"],
        "eos_token_id": _SPECIAL["eos_token"],
        "pad_token_id": _SPECIAL["pad_token"],
        "tie_word_embeddings": False,
        "max_position_embeddings": _MAX_POSITIONS,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        "initializer_range": 0.02,
    }
    if arch == "llama":
        if mtp:
            raise ModelGenError("--mtp needs --arch nemotron_h (Llama has no MTP head)")
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            **common,
        }
    if arch == "nemotron_h":
        cfg: dict[str, object] = {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "hidden_size": 256,
            # Mamba2 (M), MLP (-) and attention (*) layers: a real hybrid.
            "hybrid_override_pattern": "M-M*M-",
            "num_hidden_layers": 6,
            "intermediate_size": 512,
            "mlp_hidden_act": "relu2",
            "mlp_bias": False,
            "use_bias": False,
            "layer_norm_epsilon": 1e-5,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "attention_bias": False,
            "mamba_num_heads": 8,
            "mamba_head_dim": 64,
            "ssm_state_size": 64,
            "n_groups": 2,
            "conv_kernel": 4,
            "expand": 2,
            "chunk_size": 128,
            "use_conv_bias": True,
            "mamba_hidden_act": "silu",
            "mamba_proj_bias": False,
            "time_step_min": 0.001,
            "time_step_max": 0.1,
            "time_step_floor": 0.0001,
            "mamba_ssm_cache_dtype": "float32",
            "residual_in_fp32": False,
            "rescale_prenorm_residual": True,
            "num_nextn_predict_layers": 0,
            **common,
        }
        if mtp:
            cfg.update(
                {
                    "num_nextn_predict_layers": 1,
                    "mtp_hybrid_override_pattern": mtp_pattern,
                    "n_routed_experts": 4,
                    "n_shared_experts": 1,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 256,
                    "moe_shared_expert_intermediate_size": 256,
                    "routed_scaling_factor": 1.0,
                    "n_group": 1,
                    "topk_group": 1,
                    "norm_topk_prob": True,
                }
            )
        return cfg
    raise ModelGenError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def write_tokenizer(out_dir: Path, *, vocab_size: int, max_length: int = 4096) -> None:
    """Write a local WordLevel tokenizer (``<pad> <s> </s> <unk> t4 .. t{vocab_size-1}``)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError as exc:  # pragma: no cover - tokenizers is a core dependency
        raise ModelGenError("the 'tokenizers' package is missing; pip install tokenizers") from exc
    vocab = {_SPECIAL_TEXT.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(out_dir / "tokenizer.json"))
    names = {k: _SPECIAL_TEXT[v] for k, v in _SPECIAL.items()}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "unk_token": "<unk>",
        **names,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # Plain concatenation: a chat request costs exactly its content tokens.
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} "
        "{% endif %}{% endfor %}",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(names, indent=2))


_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Text to train a BPE tokenizer on: this package's own sources and docs (always here)."""
    root = Path(__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    for extra in ("README.md", "docs"):
        p = root.parent / extra
        files += sorted(p.rglob("*.md")) if p.is_dir() else ([p] if p.is_file() else [])
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def write_bpe_tokenizer(out_dir: Path, *, vocab_size: int, max_length: int = 4096) -> int:
    """Train a byte-level BPE tokenizer (GPT-2 style) here and write it with a ChatML
    chat template; returns the number of tokens it has (at most ``vocab_size``).

    A stand-in for a real model's tokenizer: multi-token words, merges, special tokens
    and a template that adds role markers, so prompt lengths are not one token per word.
    The special ids match the tiny models' config (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2).
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - tokenizers is a core dependency
        raise ModelGenError("the 'tokenizers' package is missing; pip install tokenizers") from exc
    specials = [_SPECIAL_TEXT[i] for i in range(4)] + ["<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    names = {k: _SPECIAL_TEXT[v] for k, v in _SPECIAL.items()}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        **names,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": _CHATML,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(names, indent=2))
    return int(tok.get_vocab_size())


def generate_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: Arch = "nemotron_h",
    vocab_size: int = 4096,
    mtp: bool = False,
    mtp_pattern: str = "*E",
    seed: int = 0,
    peak: float = 8.0,
    tokenizer: TokenizerKind = "words",
) -> Path:
    """Write a tiny random-weight model of ``arch`` to ``out_dir`` and return its path.

    ``tokenizer``: "words" (token i is ``t<i>``, one token per word) or "bpe" (a byte-level
    BPE trained here on autotune's own text, with a ChatML chat template: behaves like a
    real model's tokenizer). ``peak`` scales the output projection so greedy decoding is
    decisive (1.0 = plain random init). Raises :class:`ModelGenError` if the directory
    holds something else.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        raise ModelGenError(
            f"{out} exists and is not a model directory; choose an empty or new directory"
        )
    if tokenizer not in TOKENIZERS:
        raise ModelGenError(
            f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}"
        )
    cfg = tiny_config(arch, vocab_size=vocab_size, mtp=mtp, mtp_pattern=mtp_pattern)
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelGenError(
            "generating weights needs torch and transformers; install the 'cpu' or 'gpu' "
            "extra (pip install -e '.[cpu]')"
        ) from exc

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling, then swap in: a crash never leaves a half model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        hf_config = transformers.AutoConfig.from_pretrained(str(tmp))
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        with torch.no_grad():
            head = model.get_output_embeddings()
            if head is not None and peak != 1.0:
                head.weight.mul_(peak)
        model = model.to(torch.bfloat16)
        nparams = sum(p.numel() for p in model.parameters())
        model.save_pretrained(str(tmp), safe_serialization=True)
        # save_pretrained rewrites config.json; keep the fields vLLM reads verbatim.
        saved = json.loads((tmp / "config.json").read_text())
        saved.update(cfg)
        (tmp / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True))
        (tmp / "generation_config.json").write_text(
            json.dumps(
                {
                    "bos_token_id": _SPECIAL["bos_token"],
                    "eos_token_id": _SPECIAL["eos_token"],
                    "pad_token_id": _SPECIAL["pad_token"],
                },
                indent=2,
            )
        )
        if tokenizer == "bpe":
            write_bpe_tokenizer(tmp, vocab_size=vocab_size,
                                max_length=_MAX_POSITIONS)
        else:
            write_tokenizer(tmp, vocab_size=vocab_size,
                            max_length=_MAX_POSITIONS)
        (tmp / "autotune-model.json").write_text(
            json.dumps(
                {"arch": arch, "vocab_size": vocab_size, "mtp": mtp, "seed": seed,
                 "peak": peak, "parameters": nparams, "tokenizer": tokenizer},
                indent=2,
            )
        )
        if out.exists():
            import shutil

            shutil.rmtree(out)
        os.replace(tmp, out)
    except ModelGenError:
        raise
    except Exception as exc:
        raise ModelGenError(f"could not generate the {arch} model in {out}: {exc}") from exc
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s model with %.1f M parameters to %s", arch, nparams / 1e6, out)
    return out
