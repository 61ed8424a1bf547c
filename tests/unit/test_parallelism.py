"""vLLM's parallelism rules from config.json, the GPU count of a config, and the pool that
places trials on whole GPUs of one node (pure logic: no server, no Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.errors import AutotuneError
from autotune.parallelism import (
    GpuPool,
    ModelSize,
    Node,
    ParallelRules,
    parallel_sizes,
    server_gpus,
)
from autotune.space import ModelFacts, load_space
from tests.conftest import REPO

# published configs (config.json figures as released; parameter counts as announced)
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
             "vocab_size": 128256, "torch_dtype": "bfloat16",
             "max_position_embeddings": 131072}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "vocab_size": 151936, "torch_dtype": "bfloat16",
                 "max_position_embeddings": 40960}
NEMOTRON_NANO_30B = {
    "model_type": "nemotron_h", "hidden_size": 2688, "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "mamba_num_heads": 64, "mamba_head_dim": 64,
    "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "intermediate_size": 1856,
    "moe_intermediate_size": 1856, "n_routed_experts": 128, "n_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 3712, "vocab_size": 131072, "mlp_hidden_act": "relu2",
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "torch_dtype": "bfloat16", "num_hidden_layers": 52, "max_position_embeddings": 262144}


def _tp(tp: int, *more: str) -> list[str]:
    return ["--max-model-len", "8192", "--tensor-parallel-size", str(tp), *more]


@pytest.mark.parametrize("flags,gpus", [
    ([], 1), (["-tp", "2"], 2), (["--tensor-parallel-size=4", "--data-parallel-size", "2"], 8),
    (["-tp", "2", "-pp", "2", "-dp", "2", "--enable-expert-parallel"], 8),
    (["--tensor-parallel-size", "2", "--tensor-parallel-size", "4"], 4),  # the last one wins
])
def test_the_gpus_of_a_server_come_from_its_flags(flags: list[str], gpus: int) -> None:
    assert server_gpus(flags) == gpus


def test_expert_parallelism_adds_no_gpu_and_its_negation_turns_it_off() -> None:
    assert parallel_sizes(["-ep", "-dp", "2"])["expert"] is True
    assert parallel_sizes(["--enable-expert-parallel", "--disable-expert-parallel"])[
        "expert"] is False
    assert server_gpus(["--enable-expert-parallel"]) == 1


@pytest.mark.parametrize("cfg,billions", [(LLAMA_70B, 70.6), (QWEN3_30B_A3B, 30.5),
                                          (NEMOTRON_NANO_30B, 31.6)])
def test_the_weight_estimate_matches_published_parameter_counts(cfg: dict[str, Any],
                                                                billions: float) -> None:
    assert ModelSize.from_config(cfg).params / 1e9 == pytest.approx(billions, rel=0.03)


def test_tensor_parallelism_must_divide_the_heads() -> None:
    rules = ParallelRules(size=ModelSize.from_config(
        {**LLAMA_70B, "num_attention_heads": 24, "num_key_value_heads": 6}))
    assert rules.check({}, _tp(2)) == []
    assert rules.check({}, _tp(3)) == []  # 24 and 6 heads split three ways
    why = rules.check({}, _tp(4))
    assert why == ["tensor parallel size 4 neither divides the model's 6 KV heads nor is a "
                   "multiple of them (vLLM splits or replicates them)"]
    assert any("does not divide the model's 24 attention heads" in w
               for w in rules.check({}, _tp(16)))
    # more ranks than KV heads: vLLM replicates them (8 KV heads over TP 16 is fine)
    assert ParallelRules(size=ModelSize.from_config(LLAMA_70B)).check({}, _tp(16)) == []


def test_mamba_heads_bind_tensor_parallelism_of_a_hybrid() -> None:
    rules = ParallelRules(size=ModelSize.from_config({**NEMOTRON_NANO_30B, "mamba_num_heads": 40,
                                                      "num_attention_heads": 32}))
    assert rules.check({}, _tp(16)) == [
        "tensor parallel size 16 does not divide the model's 40 Mamba heads "
        "(config.json mamba_num_heads)"]


def test_expert_parallelism_only_for_a_moe_model() -> None:
    ep = _tp(2, "--enable-expert-parallel")
    assert ParallelRules(size=ModelSize.from_config(QWEN3_30B_A3B)).check({}, ep) == []
    assert ParallelRules(size=ModelSize.from_config(LLAMA_70B)).check({}, ep) == [
        "expert parallelism needs a mixture-of-experts model; config.json names no routed "
        "experts"]


def test_a_server_over_the_node_gpus_is_refused_with_the_count() -> None:
    rules = ParallelRules(size=ModelSize.from_config(QWEN3_30B_A3B), node=Node(gpus=4))
    assert rules.check({}, _tp(4)) == []
    assert rules.check({}, _tp(4, "--data-parallel-size", "2")) == [
        "TP 4 x DP 2 = 8 GPUs for one server, but a node has 4: lower the parallel sizes, "
        "or add a node with more GPUs"]


def test_weights_and_the_smallest_kv_cache_must_fit_each_gpu() -> None:
    """Llama 70B (141 GB of bf16 weights) on 80-GiB GPUs: TP 1 cannot hold it, TP 2 can;
    the reason states the estimate's figures."""
    rules = ParallelRules(size=ModelSize.from_config(LLAMA_70B), node=Node(8, 80.0))
    (why,) = rules.check({}, _tp(1))
    assert why.startswith("estimated from config.json: weights 131.4 GiB + the smallest KV "
                          "cache 2.50 GiB (8192 tokens) per GPU at TP 1 exceed 72.0 GiB (0.9 "
                          "of 80 GiB; 70.55 B parameters)")
    assert rules.check({}, _tp(2)) == []
    # a lower memory share or a longer context than fits is refused at TP 2 too
    assert rules.check({}, _tp(2, "--gpu-memory-utilization", "0.5"))
    assert rules.check({}, _tp(2, "--max-model-len", "131072"))
    # fp8 weights halve them; the estimate is off where a GPU's memory is unknown
    assert rules.check({}, _tp(1, "--quantization", "fp8")) == []
    assert ParallelRules(size=ModelSize.from_config(LLAMA_70B)).check({}, _tp(1)) == []


def test_expert_parallelism_spreads_the_experts_over_tp_x_dp() -> None:
    rules = ParallelRules(size=ModelSize.from_config(QWEN3_30B_A3B))
    split = rules.memory(_tp(2, "--data-parallel-size", "2")).weights
    spread = rules.memory(_tp(2, "--data-parallel-size", "2", "--enable-expert-parallel")).weights
    assert spread < 0.6 * split  # most of its weights are experts, now over 4 ranks, not 2


def test_the_pool_never_gives_a_gpu_twice_and_keeps_big_holes() -> None:
    pool = GpuPool({"a": [0, 1, 2, 3], "b": [0, 1]})
    assert pool.largest_node == 4 and pool.total == 6
    node, _ = pool.take(1)
    assert node == "b"  # best fit: the small node, so that "a" keeps 4 free
    assert pool.fits(4) and not pool.fits(5)
    _, four = pool.take(4)
    assert len(set(four)) == 4 and not pool.fits(2) and pool.fits(1)
    with pytest.raises(AutotuneError, match="no node has 2 free GPU"):
        pool.take(2)
    pool.release("a", four)
    with pytest.raises(AutotuneError, match="were not taken"):
        pool.release("a", four)
    assert pool.free() == 5


@pytest.mark.parametrize("name", ["dense.yaml", "hybrid-mtp.yaml"])
def test_the_committed_spaces_search_parallelism_only_on_a_multi_gpu_node(name: str) -> None:
    path = Path(REPO / "search_spaces" / name)
    one = load_space(path, facts=ModelFacts(device="cuda", gpus=1, moe=True))
    four = load_space(path, facts=ModelFacts(device="cuda", gpus=4, moe=True))
    for knob in ("tensor_parallel_size", "data_parallel_size"):
        assert not one.is_active(knob, {}) and four.is_active(knob, {})
    assert four.is_active("enable_expert_parallel",
                          {"tensor_parallel_size": 2, "data_parallel_size": 1})
    assert not four.is_active("enable_expert_parallel",
                              {"tensor_parallel_size": 1, "data_parallel_size": 1})
    dense = load_space(path, facts=ModelFacts(device="cuda", gpus=4, moe=False))
    assert not dense.is_active("enable_expert_parallel", {"tensor_parallel_size": 2})
    flags = four.launch_spec({"tensor_parallel_size": 2, "data_parallel_size": 2,
                              "enable_expert_parallel": True}).flags
    assert server_gpus(flags) == 4 and "--enable-expert-parallel" in flags
    # expert parallelism off is vLLM's default: no flag (0.33 renamed its negation)
    off = four.launch_spec({"tensor_parallel_size": 2, "enable_expert_parallel": False}).flags
    assert not any("expert" in f for f in off)
    assert four.baseline_params()["tensor_parallel_size"] == 1
