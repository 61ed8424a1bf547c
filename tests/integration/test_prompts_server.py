"""A real CPU vLLM on a tiny model with a trained BPE tokenizer: the server counts exactly
the prompt tokens the shape asks for, through the chat API (template overhead included)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autotune.traffic import load_shape
from tests.conftest import needs_vllm

REPO = Path(__file__).resolve().parents[2]
# what these tests check (token counts, drafts) needs a few segments, not the 2 % default
# precision: segments of 4 requests (4 streams), 10 % precision, 8-s caps (CI time, not
# accuracy; the prompt-token count asserted, > 240, is a few requests of example-chat)
SHORT = {"segment_requests": 4, "precision": 0.1, "warmup_max_s": 8.0, "measure_max_s": 8.0}


@pytest.mark.slow
@needs_vllm
def test_bpe_chat_server_prompt_tokens_equal_the_shapes(tmp_path: Path) -> None:
    from autotune.engine import generate_tiny_model
    from autotune.load import ModelPrompts
    from autotune.trial import run_trial
    from tests._specs import flat_spec

    model = generate_tiny_model(tmp_path / "bpe-llama", arch="llama", tokenizer="bpe")
    assert ModelPrompts(model, api="chat").overhead > 0  # the template adds tokens
    spec = flat_spec(
        number=0, model=str(model), flags=("--max-model-len", "2048", "-O0"), env={},
        shape=load_shape(REPO / "traffic" / "example-chat.json"), seed=5, api="chat",
        num_requests=24, concurrency=4, warmup_requests=2, log_dir=str(tmp_path),
        start_timeout_s=float(os.environ.get("AUTOTUNE_TEST_START_TIMEOUT", "400")), **SHORT,
    )  # fmt: skip
    out = run_trial(spec)
    assert out.ok, out.message
    m = out.metrics
    assert m["n_errors"] == 0
    # vllm:prompt_tokens_total over the measured runs vs the shape's prompt lengths of the
    # requests they served (a closed loop is refilled until precise: more than 24)
    assert m["server_prompt_tokens_run"] == m["shape_prompt_tokens"] > 24 * 10


@pytest.mark.slow
@needs_vllm
def test_cpu_space_mtp_trial_serves_drafts_on_the_cpu_build(tmp_path: Path) -> None:
    """A tiny hybrid with an attention-only MTP block, launched as cpu.yaml launches an
    MTP-depth-1 trial: the CPU build serves it and counts its drafts."""
    from autotune.engine import generate_tiny_model
    from autotune.space import ModelFacts, load_space
    from autotune.trial import run_trial
    from tests._specs import flat_spec

    model = generate_tiny_model(tmp_path / "mtp", arch="nemotron_h", mtp=True, mtp_pattern="*")
    facts = ModelFacts.from_model_dir(model, device="cpu")
    space = load_space(REPO / "search_spaces" / "cpu.yaml", facts=facts)
    launch = space.launch_spec({"max_num_seqs": 8, "max_num_batched_tokens": 2048,
                                "mtp_depth": 1})
    spec = flat_spec(
        number=0, model=str(model), flags=launch.flags, env=dict(launch.env),
        shape=load_shape(REPO / "traffic" / "example-chat.json"), seed=1, num_requests=12,
        concurrency=4, warmup_requests=2, log_dir=str(tmp_path),
        start_timeout_s=float(os.environ.get("AUTOTUNE_TEST_START_TIMEOUT", "400")), **SHORT,
    )  # fmt: skip
    out = run_trial(spec)
    assert out.ok, out.message
    assert out.metrics["server_spec_drafts"] > 0
    assert out.metrics["server_prompt_tokens_run"] == out.metrics["shape_prompt_tokens"]
