"""The quality gate: probe, comparison, thresholds, reference cache, and real drift on vLLM. (the pure part: no server, no subprocess; the rest is tests/integration/test_quality.py)"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from autotune.errors import AutotuneError, ConfigError, SpaceError
from autotune.quality import (
    ProbeOutputs,
    QualityRecord,
    QualityReport,
    QualitySpec,
    QualityThresholds,
    ReferenceCache,
    build_probe,
    compare,
    ensure_reference,
    lm_eval_command,
    parse_quality,
    quality_violation,
    reference_params,
)
from autotune.space import ModelFacts, load_space
from tests._quality import VOCAB, _small_probe
from tests.conftest import REPO


def _outputs(tokens: list[list[int]], logprobs: list[list[float | None]] | None = None,
             digest: str = "d") -> ProbeOutputs:
    lps = logprobs if logprobs is not None else [[-1.0] * len(t) for t in tokens]
    return ProbeOutputs(probe_digest=digest, token_ids=tuple(tuple(t) for t in tokens),
                        logprobs=tuple(tuple(x) for x in lps))


def test_probe_is_deterministic_and_capped() -> None:
    spec = QualitySpec(n_prompts=40, max_input_tokens=256, output_tokens=16, seed=3)
    a = build_probe(vocab_size=VOCAB, spec=spec)
    b = build_probe(vocab_size=VOCAB, spec=spec)
    assert a == b and a.digest == b.digest
    assert len(a.prompts) == 40 and a.output_tokens == 16
    assert all(1 <= len(p) <= 256 for p in a.prompts)
    assert all(4 <= t < VOCAB for p in a.prompts for t in p)
    other = build_probe(vocab_size=VOCAB, spec=spec.model_copy(update={"seed": 4}))
    assert other.digest != a.digest
    # what decides the outputs is in the digest; the timeout is not
    assert build_probe(vocab_size=VOCAB, spec=spec.model_copy(
        update={"output_tokens": 17})).digest != a.digest
    assert build_probe(vocab_size=VOCAB, spec=spec.model_copy(
        update={"request_timeout_s": 9.0})).digest == a.digest


def test_probe_respects_max_model_len() -> None:
    p = build_probe(vocab_size=VOCAB, spec=QualitySpec(output_tokens=32), max_model_len=100)
    assert max(len(x) for x in p.prompts) == 68
    with pytest.raises(ConfigError, match="max_model_len 20"):
        build_probe(vocab_size=VOCAB, spec=QualitySpec(output_tokens=32), max_model_len=20)


def test_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        QualitySpec(n_prompts=0)
    with pytest.raises(ValueError):
        QualitySpec(bogus=1)  # type: ignore[call-arg]


def test_identical_outputs_agree_fully() -> None:
    ref = _outputs([[5, 6, 7, 8], [9, 10, 11, 12]], [[-0.5, -1.0, -2.0, -0.1]] * 2)
    r = compare(ref, ref)
    assert r.exact_match_rate == 1.0
    assert r.first_divergence_mean == 4.0 and r.first_divergence_p10 == 4.0
    assert r.mean_abs_logprob_diff == 0.0 and r.shared_tokens == 8
    flat = r.flat()
    assert flat["quality_exact_match_rate"] == 1.0 and flat["quality_n_prompts"] == 2.0
    assert all(k.startswith("quality_") and isinstance(v, float) for k, v in flat.items())


def test_divergence_positions_and_logprob_diff_on_shared_prefix() -> None:
    ref = _outputs([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]],
                   [[-1.0, -1.0, -1.0, -1.0]] * 4)
    cand = _outputs([[1, 2, 3, 4], [1, 2, 9, 9], [7, 2, 3, 4], [1, 2, 3]],
                    [[-1.0, -1.0, -1.0, -1.0], [-1.5, -1.0, -5.0, -5.0],
                     [-9.0, -1.0, -1.0, -1.0], [-1.0, -1.25, -1.0]])
    r = compare(ref, cand)
    assert r.exact_match_rate == 0.25
    # divergence at 4 (exact), 2, 0, 3 (a shorter output diverges where it ends)
    assert r.first_divergence_mean == pytest.approx((4 + 2 + 0 + 3) / 4)
    assert r.first_divergence_p10 == pytest.approx(0.6)
    # shared prefix: 4 + 2 + 0 + 3 tokens; differences 0.5 (prompt 2 pos 0), 0.25 (prompt 4)
    assert r.shared_tokens == 9
    assert r.mean_abs_logprob_diff == pytest.approx(0.75 / 9)
    assert r.max_abs_logprob_diff == pytest.approx(0.5)
    # what a trial stores (autotune.quality): the report's JSON, the typed record's keys
    rec = r.record()
    assert set(rec) == set(QualityRecord.__annotations__) == set(QualityReport.model_fields)
    assert QualityReport.model_validate(rec) == r and rec["shared_tokens"] == 9


def test_missing_logprobs_and_total_divergence() -> None:
    ref = _outputs([[1, 2, 3]], [[None, -1.0, -1.0]])
    cand = _outputs([[1, 2, 3]], [[-1.0, None, -2.0]])
    r = compare(ref, cand)  # only the last position has both logprobs
    assert r.exact_match_rate == 1.0 and r.shared_tokens == 1
    assert r.mean_abs_logprob_diff == pytest.approx(1.0)

    r0 = compare(_outputs([[1, 2]]), _outputs([[3, 4]]))
    assert r0.exact_match_rate == 0.0 and r0.first_divergence_mean == 0.0
    assert r0.mean_abs_logprob_diff is None and r0.shared_tokens == 0
    assert "quality_mean_abs_logprob_diff" not in r0.flat()
    assert all(math.isfinite(v) for v in r0.flat().values())

    empty = compare(_outputs([[]]), _outputs([[]]))  # no tokens at all still compares
    assert empty.exact_match_rate == 1.0 and empty.mean_abs_logprob_diff is None


def test_outputs_validate_their_lengths() -> None:
    out = ProbeOutputs.model_validate(
        {"probe_digest": "d", "token_ids": [[1, 2]], "logprobs": [[None, -1.0]]})
    assert out.logprobs == ((None, -1.0),)
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        ProbeOutputs(probe_digest="d", token_ids=((1, 2),), logprobs=((-1.0,),))


def test_compare_rejects_mismatched_inputs() -> None:
    with pytest.raises(AutotuneError, match="different probes"):
        compare(_outputs([[1]], digest="a"), _outputs([[1]], digest="b"))
    with pytest.raises(AutotuneError, match="same, non-zero number"):
        compare(_outputs([[1], [2]]), _outputs([[1]]))
    with pytest.raises(AutotuneError, match="same, non-zero number"):
        compare(_outputs([]), _outputs([]))


def test_parse_quality() -> None:
    t = parse_quality("min_agreement=0.95")
    assert t == QualityThresholds(min_agreement=0.95)
    t = parse_quality(" min_agreement=0.9, max_logprob_diff=0.01 min_divergence_p10=16 ")
    assert (t.min_agreement, t.max_logprob_diff, t.min_divergence_p10) == (0.9, 0.01, 16.0)


@pytest.mark.parametrize("text, match", [
    ("", "empty"),
    ("  , ", "empty"),
    ("min_agreement", "not KEY=VALUE"),
    ("min_agreement=", "not KEY=VALUE"),
    ("=0.9", "not KEY=VALUE"),
    ("agreement=0.9", "unknown key 'agreement'; use one of min_agreement"),
    ("min_agreement=high", "'high' is not a number"),
    ("min_agreement=nan", "finite"),
    ("min_agreement=1.5", "min_agreement=1.5 is out of range"),
    ("max_logprob_diff=-1", "max_logprob_diff=-1.0 is out of range"),
    ("min_agreement=0.9,min_agreement=0.8", "given twice"),
])
def test_parse_quality_errors(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_quality(text)


def _report(**kw: Any) -> QualityReport:
    base: dict[str, Any] = {
        "n_prompts": 48, "exact_match_rate": 1.0, "first_divergence_mean": 32.0,
        "first_divergence_p10": 32.0, "mean_abs_logprob_diff": 0.0, "max_abs_logprob_diff": 0.0,
        "output_tokens": 32.0, "shared_tokens": 1536,
    }
    return QualityReport(**{**base, **kw})


def test_quality_violation() -> None:
    t = parse_quality("min_agreement=0.95,max_logprob_diff=0.01,min_divergence_p10=16")
    assert quality_violation(_report(), t) == 0.0
    assert quality_violation(_report(), QualityThresholds()) == 0.0
    v = quality_violation(_report(exact_match_rate=0.80), t)
    assert v == pytest.approx(0.15 / 0.95)
    assert quality_violation(_report(mean_abs_logprob_diff=0.02), t) == pytest.approx(1.0)
    assert quality_violation(_report(mean_abs_logprob_diff=None), t) == 1.0
    assert quality_violation(_report(first_divergence_p10=8.0), t) == pytest.approx(0.5)
    worse = quality_violation(_report(exact_match_rate=0.5, first_divergence_p10=0.0), t)
    assert worse > v > 0


@pytest.mark.parametrize("path", sorted((REPO / "search_spaces").glob("*.yaml")),
                         ids=lambda p: p.name)
@pytest.mark.parametrize("hybrid", [True, False])
def test_reference_params_of_committed_spaces(path: Path, hybrid: bool) -> None:
    space = load_space(path, facts=ModelFacts(hybrid=hybrid))
    ref = reference_params(space)
    for name, knob in space.knobs.items():
        if knob.lossy and space.is_active(name, ref):
            assert ref[name] == knob.default
            assert not space.lossy_knobs(ref)
    assert not space.violations(ref)


def test_reference_params_sets_lossy_knobs_to_their_defaults(tmp_path: Path) -> None:
    p = tmp_path / "s.yaml"
    p.write_text("""
name: t
knobs:
  seqs: {type: int, low: 4, high: 64, flag: --max-num-seqs}
  ssm: {type: categorical, choices: [float32, bfloat16], flag: --mamba-ssm-cache-dtype,
        when: hybrid, default: float32, lossy: true}
  kv: {type: categorical, choices: [auto, fp8_e4m3], flag: --kv-cache-dtype, default: auto,
       lossy: true}
""")
    space = load_space(p, facts=ModelFacts(hybrid=True))
    assert reference_params(space) == {"ssm": "float32", "kv": "auto"}
    trial = {"ssm": "bfloat16", "kv": "fp8_e4m3", "seqs": 8}
    assert reference_params(space, trial) == {"ssm": "float32", "kv": "auto", "seqs": 8}
    flags = space.launch_spec(reference_params(space)).flags
    assert flags == ("--mamba-ssm-cache-dtype", "float32", "--kv-cache-dtype", "auto")
    plain = load_space(p, facts=ModelFacts(hybrid=False))
    assert reference_params(plain, trial) == {"kv": "auto", "seqs": 8}


def test_reference_params_needs_a_default(tmp_path: Path) -> None:
    p = tmp_path / "s.yaml"
    p.write_text("name: t\nknobs:\n  kv: {type: categorical, choices: [auto, fp8], "
                 "flag: --kv-cache-dtype, lossy: true}\n")
    with pytest.raises(SpaceError, match="'kv' is lossy but has no 'default'"):
        reference_params(load_space(p))


def _fake_model(tmp_path: Path) -> Path:
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"vocab_size": 4096}')
    return m


def test_cache_roundtrip_key_and_atomic_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ReferenceCache(tmp_path / "cache")
    model = _fake_model(tmp_path)
    probe = _small_probe()
    out = _outputs([[1, 2, 3, 4, 5]] * 6, digest=probe.digest)
    key = cache.key(model=model, probe=probe, flags=["-O0"], env={"A": "1"}, engine="vllm x")
    assert cache.load(key) is None
    path = cache.save(key, out)
    assert cache.load(key) == out
    assert [p.name for p in path.parent.iterdir() if not p.name.endswith(".lock")] == [path.name]
    doc = json.loads(path.read_text())
    assert doc["key"]["flags"] == ["-O0"] and doc["key"]["engine"] == "vllm x"
    # another flag, env, engine, probe or model content is another key
    assert cache.key(model=model, probe=probe, flags=["-O1"], env={"A": "1"}, engine="vllm x") != key
    assert cache.key(model=model, probe=probe, flags=["-O0"], env={}, engine="vllm x") != key
    assert cache.key(model=model, probe=probe, flags=["-O0"], env={"A": "1"}, engine="y") != key
    (model / "config.json").write_text('{"vocab_size": 4097}')
    assert cache.key(model=model, probe=probe, flags=["-O0"], env={"A": "1"}, engine="vllm x") != key

    # a failed replace leaves the old file whole and no temp file behind
    good = path.read_bytes()

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(AutotuneError, match="cannot write the reference cache"):
        cache.save(key, out)
    assert path.read_bytes() == good
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_cache_rejects_outputs_of_another_probe(tmp_path: Path) -> None:
    cache = ReferenceCache(tmp_path)
    probe = _small_probe()
    key = cache.key(model="m", probe=probe, flags=[], engine="e")
    with pytest.raises(AutotuneError, match="another probe"):
        cache.save(key, _outputs([[1]], digest="other"))


def test_ensure_reference_propagates_start_failures(tmp_path: Path) -> None:
    from autotune.errors import EngineStartError

    @contextmanager
    def start() -> Iterator[Any]:
        raise EngineStartError("no", reason="oom")
        yield  # pragma: no cover

    with pytest.raises(EngineStartError):
        ensure_reference(ReferenceCache(tmp_path), model="m", reference_flags=[],
                         reference_env=None, probe=_small_probe(), start_server=start, engine="e")
    assert not list(tmp_path.glob("quality-reference-*.json"))


def test_lm_eval_command() -> None:
    cmd = lm_eval_command("http://127.0.0.1:8000/", "autotune-model", ["gsm8k", "arc_easy"],
                          tokenizer="/models/m", limit=200, num_fewshot=5, max_length=4096,
                          output_path="out/lm_eval")
    assert cmd[:3] == ["lm_eval", "--model", "local-completions"]
    args = dict(kv.split("=", 1) for kv in cmd[cmd.index("--model_args") + 1].split(","))
    assert args["base_url"] == "http://127.0.0.1:8000/v1/completions"
    assert args["model"] == "autotune-model" and args["tokenizer"] == "/models/m"
    assert args["max_length"] == "4096" and args["num_concurrent"] == "8"
    assert cmd[cmd.index("--tasks") + 1] == "gsm8k,arc_easy"
    assert cmd[cmd.index("--limit") + 1] == "200" and cmd[cmd.index("--num_fewshot") + 1] == "5"
    assert lm_eval_command("http://h:1", "m", ["x"], limit=0.1)[-1] == "0.1"


@pytest.mark.parametrize("kw, match", [
    ({"tasks": []}, "one or more task"),
    ({"tasks": ["a,b"]}, "without commas"),
    ({"tasks": ["a"], "tokenizer": "/p,q"}, "cannot carry"),
    ({"tasks": ["a"], "num_concurrent": 0}, "must be >= 1"),
    ({"tasks": ["a"], "limit": 0}, "must be > 0"),
])
def test_lm_eval_command_errors(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        lm_eval_command("http://h:1", "m", **kw)


def test_a_study_of_another_shape_reads_the_reference_its_model_cached(
        tmp_path: Path, fake_model: Path) -> None:
    """The quality reference (one server start, 49-70 s on the CPU) is cached per model,
    flags, engine and probe, and the probe is the same for every shape: a study of the
    same model on another shape reads it from the cache and starts no server for it."""
    from types import SimpleNamespace

    from autotune.quality import ProbeOutputs, ReferenceCache, reference_params
    from autotune.space import ModelFacts, load_space
    from autotune.study import _quality_reference
    from autotune.traffic import load_shape
    from tests.conftest import REPO

    space = load_space(REPO / "search_spaces" / "cpu.yaml",
                       facts=ModelFacts.from_model_dir(fake_model, device="cpu"))

    def inputs(shape: str) -> SimpleNamespace:
        return SimpleNamespace(
            settings=SimpleNamespace(quality=None, seed=1, measure=SimpleNamespace(
                start_timeout_s=5.0, cpu_kv_cache_gib=None)),
            model=fake_model, space=space, engine=SimpleNamespace(device="cpu"),
            shape=load_shape(REPO / "traffic" / shape), cache_dir=tmp_path / "cache",
            log_dir=tmp_path / "logs")

    # the first study (example-chat) computed its reference: in the cache as it keeps it
    from autotune.study._study import _quality_probe

    ref = space.launch_spec(reference_params(space))
    first = inputs("example-chat.json")
    probe = _quality_probe(first, ref.flags)  # type: ignore[arg-type]
    outputs = ProbeOutputs(probe_digest=probe.digest,
                           token_ids=tuple((5,) * probe.output_tokens for _ in probe.prompts),
                           logprobs=tuple((-0.5,) * probe.output_tokens for _ in probe.prompts))
    cache = ReferenceCache(tmp_path / "cache" / "quality")
    cache.save(cache.key(model=fake_model, probe=probe, flags=ref.flags, env=ref.env), outputs)
    # a study of another shape (longer prompts, another mix): the same probe, a cache hit
    notes: list[str] = []
    got_probe, got = _quality_reference(inputs("azure-conv.json"), notes.append)  # type: ignore[arg-type]
    assert got_probe == probe and got == outputs
    assert len(notes) == 1 and "the same for every shape; from the cache" in notes[0], notes
    assert not (tmp_path / "logs" / "quality-reference.log").exists()  # no server started
    assert len(list((tmp_path / "cache" / "quality").glob("quality-reference-*.json"))) == 1
