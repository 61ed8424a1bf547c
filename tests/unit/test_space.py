"""Search spaces: YAML validation, conditions, rules, derived flags, argv mapping."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune.errors import SpaceError
from autotune.space import ModelFacts, load_space

REPO = Path(__file__).resolve().parents[2]
SPACES = sorted((REPO / "search_spaces").glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", SPACES, ids=[p.name for p in SPACES])
@pytest.mark.parametrize("facts", [
    ModelFacts(device="cpu", hybrid=True), ModelFacts(device="cpu", hybrid=False),
    ModelFacts(device="cuda", hybrid=True, mtp=True, gpu_arch="sm90"),
])
def test_committed_spaces_sample_valid_argv(path: Path, facts: ModelFacts) -> None:
    space = load_space(path, facts=facts)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    seen_valid = 0
    for _ in range(40):
        trial = study.ask()
        params = space.suggest(trial)
        spec = space.launch_spec(params)
        assert all(isinstance(f, str) and f for f in spec.flags)
        for name in params:
            assert space.is_active(name, params)
        if not space.violations(params):
            seen_valid += 1
        study.tell(trial, 0.0)
    assert seen_valid > 0, "the space rejects every sample"
    base = space.launch_spec(space.baseline_params(), baseline=True)
    assert base.flags[: len(space._spec.fixed_flags)] == tuple(space._spec.fixed_flags)


def test_bool_flags_and_json_and_env(tmp_path: Path) -> None:
    space = load_space(_write(tmp_path, """
name: t
fixed_json: {--speculative-config: {method: mtp}}
knobs:
  prefix: {type: bool, flag: --enable-prefix-caching}
  mtp: {type: int, low: 0, high: 3, json: --speculative-config.num_speculative_tokens, omit_when: 0}
  omp: {type: categorical, choices: [1, 4], env: OMP_NUM_THREADS}
  level: {type: categorical, choices: [0, 3], flag: -O}
"""))
    on = space.launch_spec({"prefix": True, "mtp": 2, "omp": 1, "level": 3})
    assert "--enable-prefix-caching" in on.flags and "-O3" in on.flags
    i = on.flags.index("--speculative-config")
    assert on.flags[i + 1] == '{"method":"mtp","num_speculative_tokens":2}'
    assert on.env == {"OMP_NUM_THREADS": "1"}
    off = space.launch_spec({"prefix": False, "mtp": 0, "omp": 4, "level": 0})
    assert "--no-enable-prefix-caching" in off.flags
    assert "--speculative-config" not in off.flags  # MTP depth 0 = speculation off


def test_conditions_rules_and_derive(tmp_path: Path) -> None:
    space = load_space(_write(tmp_path, """
name: t
knobs:
  dtype: {type: categorical, choices: [float32, float16], flag: --mamba-ssm-cache-dtype, when: hybrid}
  sr: {type: bool, flag: --enable-mamba-cache-stochastic-rounding, when: "dtype == 'float16'"}
  seqs: {type: int, low: 8, high: 512, flag: --max-num-seqs}
  tokens: {type: categorical, choices: [256, 8192], flag: --max-num-batched-tokens}
derive:
  --max-cudagraph-capture-size: "min(seqs * 2, 512)"
rules:
  - {when: "tokens < seqs", reason: "tokens must be >= seqs"}
"""), facts=ModelFacts(hybrid=True))
    assert not space.is_active("sr", {"dtype": "float32"})
    assert space.is_active("sr", {"dtype": "float16"})
    assert space.violations({"dtype": "float16", "sr": True, "seqs": 300, "tokens": 256}) == [
        "tokens must be >= seqs"
    ]
    assert space.violations({"dtype": "float16", "sr": True, "seqs": 100, "tokens": 256}) == []
    flags = space.launch_spec({"seqs": 300, "tokens": 8192}).flags
    assert flags[flags.index("--max-cudagraph-capture-size") + 1] == "512"
    # not hybrid: the dtype knob and everything that depends on it disappear
    dense = load_space(tmp_path / "space.yaml", facts=ModelFacts(hybrid=False))
    study = optuna.create_study()
    params = dense.suggest(study.ask())
    assert "dtype" not in params and "sr" not in params


def test_baseline_uses_declared_defaults_only(tmp_path: Path) -> None:
    space = load_space(_write(tmp_path, """
name: t
fixed_flags: [--max-model-len, "2048"]
knobs:
  chunked: {type: bool, flag: --enable-chunked-prefill, default: true}
  seqs: {type: int, low: 8, high: 512, flag: --max-num-seqs}
"""))
    assert space.baseline_params() == {"chunked": True}
    study = optuna.create_study()
    study.enqueue_trial(space.baseline_params())
    t = study.ask()
    assert space.suggest(t, baseline=True) == {"chunked": True}
    assert space.launch_spec({"chunked": True}, baseline=True).flags == ("--max-model-len", "2048")


@pytest.mark.parametrize("text, fragment", [
    ("name: t\nknobs: {}\n", "at least one knob"),
    ("name: t\nknobs:\n  a: {type: int, low: 5, high: 1, flag: --a}\n", "low (5) is above high (1)"),
    ("name: t\nknobs:\n  a: {type: int, low: 0, high: 4, log: true, flag: --a}\n", "log-scale"),
    ("name: t\nknobs:\n  a: {type: int, low: 1, high: .inf, flag: --a}\n", "finite"),
    ("name: t\nknobs:\n  a: {type: float, low: 1, high: 2}\n", "exactly one of"),
    ("name: t\nknobs:\n  a: {type: categorical, choices: [], flag: --a}\n", "non-empty"),
    ("name: t\nknobs:\n  a: {type: bool, flag: --a, colour: red}\n", "colour"),
    ("name: t\nknobs:\n  a: {type: bool, flag: --a, when: 'b == 1'}\n", "names 'b'"),
    ("name: t\nknobs:\n  a: {type: bool, flag: --a}\nrules: [{when: '__import__(\"os\")', reason: x}]\n",
     "names '__import__'"),
    ("name: t\nknobs:\n  a: {type: bool, flag: --a}\nrules: [{when: 'a ==', reason: x}]\n", "cannot parse"),
    ("name: t\nknobs:\n  a: {type: bool, flag: --a}\nrules: [{when: 'a.real', reason: x}]\n", "not allowed"),
    ("name: t\nknobs:\n  a: {type: categorical, choices: [1, 2], flag: --a, default: 3}\n", "outside"),
    ("- just\n- a list\n", "mapping"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_invalid_spaces_are_clear_errors(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(SpaceError) as err:
        load_space(_write(tmp_path, text))
    assert fragment in str(err.value)
    assert str(tmp_path / "space.yaml") in str(err.value)


def test_missing_space_file(tmp_path: Path) -> None:
    with pytest.raises(SpaceError, match="not found"):
        load_space(tmp_path / "nope.yaml")


def test_model_facts_from_model_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "nemotron_h", "hybrid_override_pattern": "M*M", "num_nextn_predict_layers": 1}'
    )
    facts = ModelFacts.from_model_dir(tmp_path, device="cuda")
    assert facts.hybrid and facts.mtp and facts.device == "cuda"
    with pytest.raises(SpaceError, match="config.json"):
        ModelFacts.from_model_dir(tmp_path / "missing", device="cpu")


def test_cover_prefill_captures_the_traffics_mixed_step() -> None:
    from autotune.space import ModelFacts, load_space
    from autotune.study import _traffic_streams
    from autotune.traffic import load_shape

    shape = load_shape(REPO / "traffic" / "casestudy-512x512.json")
    for conc, depth, want in ((32, 0, 544), (32, 1, 576), (None, 0, 768), (None, 1, 1024)):
        facts = ModelFacts(device="cuda", hybrid=True, mtp=True, gpu_arch="sm90").with_traffic(
            streams=_traffic_streams(shape, conc), prompt_p90=shape.input_tokens.p90)
        space = load_space(REPO / "search_spaces" / "hybrid-mtp.yaml", facts=facts)
        params = {**space.baseline_params(), "cudagraph_cover_prefill": True, "mtp_depth": depth}
        flags = list(space.launch_spec(params).flags)
        assert flags[flags.index("--max-cudagraph-capture-size") + 1] == str(want)
        assert "--max-cudagraph-capture-size" not in space.launch_spec(
            space.baseline_params()).flags  # the defaults stay vLLM's


@pytest.mark.parametrize("name", ["hybrid-mtp.yaml", "dense.yaml"])
def test_fp8_weights_knob_follows_vllms_rules(tmp_path: Path, name: str) -> None:
    """`quantization`: online FP8 of a 16-bit checkpoint on a GPU; lossy; absent on the CPU
    build and for a checkpoint that is already quantized (vLLM uses the checkpoint's own
    method and rejects another --quantization)."""
    cfg = tmp_path / "config.json"
    path = REPO / "search_spaces" / name
    for dtype, quant, device, active in (
        ("bfloat16", None, "cuda", True), ("float16", None, "cuda", True),
        ("bfloat16", None, "cpu", False), ("float32", None, "cuda", False),
        ("bfloat16", {"quant_method": "fp8"}, "cuda", False),
    ):
        body: dict[str, object] = {"model_type": "llama", "torch_dtype": dtype}
        if quant:
            body["quantization_config"] = quant
        cfg.write_text(__import__("json").dumps(body))
        facts = ModelFacts.from_model_dir(tmp_path, device=device, gpu_arch="sm90")
        assert (facts.weights_dtype, facts.prequantized) == (dtype, bool(quant))
        space = load_space(path, facts=facts)
        wanted = {**space.baseline_params(), "quantization": "fp8"}
        assert space.is_active("quantization", wanted) is active, (dtype, quant, device)
        # what the sampler gives for that point (an inactive knob is None)
        fixed = {k: (wanted.get(k) if wanted.get(k) is not None else
                     kn.choices[0] if kn.choices else kn.low if kn.low is not None else False)
                 for k, kn in space.knobs.items()}
        params = space.suggest(optuna.trial.FixedTrial(fixed))
        flags = list(space.launch_spec(params).flags)
        assert (flags[flags.index("--quantization") + 1] == "fp8") if active else (
            "--quantization" not in flags and params.get("quantization") is None)
        assert space.lossy_knobs(params) == (["quantization"] if active else [])
        # the defaults never quantize
        assert "--quantization" not in space.launch_spec(space.baseline_params(),
                                                         baseline=True).flags
