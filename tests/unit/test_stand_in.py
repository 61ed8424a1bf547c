"""A space's stand_in part applies to stand-in models only (random weights)."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.space import ModelFacts, load_space

REPO = Path(__file__).resolve().parents[2]
PARAMS = {"mtp_depth": 2, "max_num_seqs": 128, "max_num_batched_tokens": 2048}


def test_real_weights_drop_dummy_load_and_synthetic_acceptance() -> None:
    flags = {}
    for real in (False, True):
        facts = ModelFacts(device="cuda", hybrid=True, mtp=True, real_weights=real)
        space = load_space(REPO / "search_spaces" / "hybrid-mtp.yaml", facts=facts)
        flags[real] = space.launch_spec(PARAMS).flags
    fake, real = flags[False], flags[True]
    assert "dummy" in fake and "dummy" not in real
    spec_fake = json.loads(fake[fake.index("--speculative-config") + 1])
    spec_real = json.loads(real[real.index("--speculative-config") + 1])
    assert spec_fake == {"method": "mtp", "num_speculative_tokens": 2,
                         "rejection_sample_method": "synthetic",
                         "synthetic_acceptance_length": 2.12}
    assert spec_real == {"method": "mtp", "num_speculative_tokens": 2}


def test_real_weights_fact_from_the_model_folder(tmp_path: Path) -> None:
    cfg = json.dumps({"model_type": "llama"})
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(cfg)
    ours = tmp_path / "ours"
    ours.mkdir()
    for f in ("config.json", "model.safetensors", "autotune-model.json"):
        (ours / f).write_text(cfg)
    real = tmp_path / "real"
    real.mkdir()
    for f in ("config.json", "model-00001-of-00002.safetensors"):
        (real / f).write_text(cfg)
    got = {d.name: ModelFacts.from_model_dir(d, device="cpu").real_weights
           for d in (bare, ours, real)}
    assert got == {"bare": False, "ours": False, "real": True}


def test_cpu_space_searches_mtp_depth_on_a_stand_in_with_dummy_weights() -> None:
    base = {"max_num_seqs": 8, "max_num_batched_tokens": 1024}
    on = ModelFacts(hybrid=True, mtp=True)
    space = load_space(REPO / "search_spaces" / "cpu.yaml", facts=on)
    flags = space.launch_spec({**base, "mtp_depth": 2}).flags
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == {
        "method": "mtp", "num_speculative_tokens": 2}
    assert flags[flags.index("--load-format") + 1] == "dummy"
    off = space.launch_spec({**base, "mtp_depth": 0}).flags
    assert "--speculative-config" not in off and "--load-format" not in off
    assert space.violations({**base, "mtp_depth": 1, "mamba_ssm_cache_dtype": "float16"})
    no_mtp = load_space(REPO / "search_spaces" / "cpu.yaml", facts=ModelFacts(hybrid=True))
    assert not no_mtp.is_active("mtp_depth", base)


def test_tiny_mtp_pattern() -> None:
    import pytest

    from autotune.errors import ModelGenError
    from autotune.engine import tiny_config

    cfg = tiny_config("nemotron_h", mtp=True, mtp_pattern="*")
    assert cfg["mtp_hybrid_override_pattern"] == "*"
    assert tiny_config("nemotron_h", mtp=True)["mtp_hybrid_override_pattern"] == "*E"
    with pytest.raises(ModelGenError, match="MTP pattern"):
        tiny_config("nemotron_h", mtp=True, mtp_pattern="M")


def test_stand_in_routes_moe_tokens_uniformly_and_real_weights_do_not() -> None:
    """vLLM's dummy weights send every token to the same experts: the stand-in simulates
    uniform routing on every trial, the baseline included; a real checkpoint routes itself."""
    from autotune.space import ROUTING_SIMULATION_ENV

    envs = {}
    for real in (False, True):
        facts = ModelFacts(device="cuda", hybrid=True, mtp=True, moe=True, real_weights=real)
        space = load_space(REPO / "search_spaces" / "hybrid-mtp.yaml", facts=facts)
        envs[real] = (space.launch_spec(PARAMS).env,
                      space.launch_spec(space.baseline_params(), baseline=True).env)
    for env in envs[False]:
        assert env[ROUTING_SIMULATION_ENV] == "uniform_random"
    for env in envs[True]:
        assert ROUTING_SIMULATION_ENV not in env


def test_simulated_routing_turns_the_quality_probe_off_without_a_server_start() -> None:
    """With simulated routing no server's tokens are the model's: the study notes that the
    probe is off (no reference server is started); asking for a quality gate is an error."""
    from types import SimpleNamespace

    import pytest

    from autotune.errors import StudyError
    from autotune.study import _quality_reference

    facts = ModelFacts(device="cuda", hybrid=True, mtp=True, moe=True)
    space = load_space(REPO / "search_spaces" / "hybrid-mtp.yaml", facts=facts)
    notes: list[str] = []
    inputs = SimpleNamespace(settings=SimpleNamespace(quality=None), model=Path("/nonexistent"),
                             space=space)
    assert _quality_reference(inputs, notes.append) == (None, None)  # type: ignore[arg-type]
    assert len(notes) == 1 and notes[0].startswith("quality probe off: the stand-in's MoE")
    inputs.settings.quality = "min_agreement=0.95"
    with pytest.raises(StudyError, match="--quality cannot be checked"):
        _quality_reference(inputs, notes.append)  # type: ignore[arg-type]


def test_bench_warns_of_dummy_routing_only_for_a_moe_model_without_a_simulator(
        tmp_path: Path) -> None:
    from autotune.space import ROUTING_SIMULATION_ENV, dummy_routing_warning

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for d, cfg in ((moe, {"model_type": "nemotron_h", "n_routed_experts": 128}),
                   (dense, {"model_type": "llama"})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    dummy = ["--max-model-len", "2048", "--load-format", "dummy"]
    msg = dummy_routing_warning(moe, dummy, {})
    assert msg is not None and f"--env {ROUTING_SIMULATION_ENV}=uniform_random" in msg
    assert "\n" not in msg
    assert dummy_routing_warning(moe, ["--load-format=dummy"], {}) is not None
    assert dummy_routing_warning(moe, dummy, {ROUTING_SIMULATION_ENV: "uniform_random"}) is None
    assert dummy_routing_warning(moe, ["--max-model-len", "2048"], {}) is None
    assert dummy_routing_warning(dense, dummy, {}) is None
    # a study says how to fix it in the space, not with bench's --env
    fix = f"set {ROUTING_SIMULATION_ENV}: uniform_random in the space's stand_in.fixed_env"
    study_msg = dummy_routing_warning(moe, dummy, {}, fix=fix)
    assert study_msg is not None and fix in study_msg and "--env" not in study_msg
