from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.errors import ModelGenError
from autotune.engine import generate_tiny_model, tiny_config


def test_tiny_hybrid_is_a_real_hybrid_under_50m(tiny_hybrid: Path) -> None:
    cfg = json.loads((tiny_hybrid / "config.json").read_text())
    assert cfg["architectures"] == ["NemotronHForCausalLM"]
    pattern = cfg["hybrid_override_pattern"]
    assert "M" in pattern and "*" in pattern  # Mamba2 and attention layers
    info = json.loads((tiny_hybrid / "autotune-model.json").read_text())
    assert 0 < info["parameters"] < 50e6
    assert (tiny_hybrid / "model.safetensors").stat().st_size > 1e6
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_hybrid / f).exists()


def test_tokenizer_round_trips_exact_lengths(tiny_llama: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    ids = [5, 900, 4095, 17, 17, 3000]
    text = tok.decode(ids)
    assert text == "t5 t900 t4095 t17 t17 t3000"
    assert tok.encode(text).ids == ids


def test_weights_load_in_transformers(tiny_llama: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape[-1] == 4096 and torch.isfinite(logits).all()


def test_bad_arguments() -> None:
    with pytest.raises(ModelGenError, match="MTP"):
        tiny_config("llama", mtp=True)
    with pytest.raises(ModelGenError, match="unknown architecture"):
        tiny_config("gpt9")  # type: ignore[arg-type]
    with pytest.raises(ModelGenError, match="at least 64"):
        tiny_config("llama", vocab_size=3)


def test_refuses_to_overwrite_a_non_model_dir(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ModelGenError, match="not a model directory"):
        generate_tiny_model(tmp_path, arch="llama")
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_mtp_config_has_vllm_fields() -> None:
    cfg = tiny_config("nemotron_h", mtp=True)
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["mtp_hybrid_override_pattern"] == "*E"
    for key in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"):
        assert key in cfg


def test_transformers_chat_template_keeps_exact_lengths(tiny_llama: Path) -> None:
    # vLLM tokenises through transformers, which matches special tokens as substrings: they
    # must not look like t<i> (a special "t1" would split "t11" into two tokens).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = [11, 12, 100, 3000, 4095, 17, 1000, 111]
    text = " ".join(f"t{i}" for i in ids)
    assert tok(text, add_special_tokens=False).input_ids == ids
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    assert list(chat["input_ids"] if hasattr(chat, "keys") else chat) == ids
