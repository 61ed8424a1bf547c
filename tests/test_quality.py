"""The quality gate: probe, comparison, thresholds, reference cache, and real drift on vLLM.

Fast tests drive the real HTTP client against a small local completions server that
answers like vLLM (``token_id:N`` tokens, ``token_logprobs``). The slow tests start real CPU
vLLM servers on the tiny hybrid model, one at a time, and check that a second start of
the reference config agrees with the reference far better than a lossy config does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import pytest
from aiohttp import web

from autotune.errors import AutotuneError, ConfigError, EngineError, SpaceError
from autotune.quality import (
    ProbeOutputs,
    ProbeSet,
    QualityRecord,
    QualityReport,
    QualitySpec,
    QualityThresholds,
    ReferenceCache,
    arun_probe,
    build_probe,
    compare,
    ensure_reference,
    lm_eval_command,
    parse_quality,
    quality_violation,
    reference_params,
    run_probe,
)
from autotune.space import ModelFacts, load_space
from autotune.traffic import LoadSpec, constant_shape
from tests.conftest import REPO, needs_vllm

VOCAB = 4096
SHAPE = constant_shape(700, 64, load=LoadSpec(mode="closed", concurrency=4))


def _outputs(tokens: list[list[int]], logprobs: list[list[float | None]] | None = None,
             digest: str = "d") -> ProbeOutputs:
    lps = logprobs if logprobs is not None else [[-1.0] * len(t) for t in tokens]
    return ProbeOutputs(probe_digest=digest, token_ids=tuple(tuple(t) for t in tokens),
                        logprobs=tuple(tuple(x) for x in lps))


# ---------------------------------------------------------------------------------------------
# build_probe


def test_probe_is_deterministic_and_capped() -> None:
    spec = QualitySpec(n_prompts=40, max_input_tokens=256, output_tokens=16, seed=3)
    a = build_probe(SHAPE, vocab_size=VOCAB, spec=spec)
    b = build_probe(SHAPE, vocab_size=VOCAB, spec=spec)
    assert a == b and a.digest == b.digest
    assert len(a.prompts) == 40 and a.output_tokens == 16
    assert all(1 <= len(p) <= 256 for p in a.prompts)
    assert all(4 <= t < VOCAB for p in a.prompts for t in p)
    other = build_probe(SHAPE, vocab_size=VOCAB, spec=spec.model_copy(update={"seed": 4}))
    assert other.digest != a.digest
    # what decides the outputs is in the digest; the timeout is not
    assert build_probe(SHAPE, vocab_size=VOCAB, spec=spec.model_copy(
        update={"output_tokens": 17})).digest != a.digest
    assert build_probe(SHAPE, vocab_size=VOCAB, spec=spec.model_copy(
        update={"request_timeout_s": 9.0})).digest == a.digest


def test_probe_respects_max_model_len() -> None:
    p = build_probe(SHAPE, vocab_size=VOCAB, spec=QualitySpec(output_tokens=32), max_model_len=100)
    assert max(len(x) for x in p.prompts) == 68
    with pytest.raises(ConfigError, match="max_model_len 20"):
        build_probe(SHAPE, vocab_size=VOCAB, spec=QualitySpec(output_tokens=32), max_model_len=20)


def test_spec_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        QualitySpec(n_prompts=0)
    with pytest.raises(ValueError):
        QualitySpec(bogus=1)  # type: ignore[call-arg]


# ---------------------------------------------------------------------------------------------
# compare


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


# ---------------------------------------------------------------------------------------------
# thresholds


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


# ---------------------------------------------------------------------------------------------
# the reference config of a space


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


# ---------------------------------------------------------------------------------------------
# a local completions server that answers like vLLM


class FakeCompletions:
    """Greedy 'model': token j of prompt p is (sum(p) + 7 j) mod V; logprob -0.1 (j+1).

    ``fault``: None, "http500", "no_logprobs", "text_tokens", "token_ids_field", "nan".
    """

    def __init__(self) -> None:
        self.fault: str | None = None
        self.requests: list[dict[str, Any]] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        if self.fault == "http500":
            return web.Response(status=500, text='{"error": "boom"}')
        prompt, n = body["prompt"], body["max_tokens"]
        ids = [(sum(prompt) + 7 * j) % VOCAB for j in range(n)]
        lps = [-0.1 * (j + 1) for j in range(n)]
        logprobs: dict[str, Any] = {"token_logprobs": lps, "tokens": [f"token_id:{i}" for i in ids]}
        choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": logprobs, "token_ids": None}
        if self.fault == "no_logprobs":
            choice["logprobs"] = None
        elif self.fault == "text_tokens":
            logprobs["tokens"] = [f"t{i}" for i in ids]
        elif self.fault == "nan":
            logprobs["token_logprobs"] = [math.nan, -math.inf, *lps[2:]]
        elif self.fault == "token_ids_field":
            logprobs["tokens"] = [f"t{i}" for i in ids]
            choice["token_ids"] = ids
        return web.json_response({"choices": [choice], "system_fingerprint": "fake-1"})

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        from autotune.engine import free_port

        self.port = free_port()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    served_model_name = "fake"

    def __enter__(self) -> Self:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def fake() -> Iterator[FakeCompletions]:
    with FakeCompletions() as f:
        yield f


def _small_probe(**kw: Any) -> ProbeSet:
    return build_probe(SHAPE, vocab_size=VOCAB,
                       spec=QualitySpec(n_prompts=6, max_input_tokens=12, output_tokens=5, **kw))


def test_run_probe_sends_greedy_logprob_requests(fake: FakeCompletions) -> None:
    probe = _small_probe(concurrency=3)
    out = run_probe(fake.base_url, "fake", probe)
    assert out.probe_digest == probe.digest and out.server == "fake-1"
    assert out.token_ids[0] == tuple((sum(probe.prompts[0]) + 7 * j) % VOCAB for j in range(5))
    assert out.logprobs[0] == pytest.approx((-0.1, -0.2, -0.3, -0.4, -0.5))
    req = fake.requests[0]
    assert req["temperature"] == 0 and req["logprobs"] == 1 and req["max_tokens"] == 5
    assert req["return_tokens_as_token_ids"] is True and req["ignore_eos"] is True
    assert sorted(tuple(r["prompt"]) for r in fake.requests) == sorted(probe.prompts)
    # order follows the probe, whatever the completion order
    assert compare(out, run_probe(fake.base_url, "fake", probe)).exact_match_rate == 1.0


def test_run_probe_turns_non_finite_logprobs_into_none(fake: FakeCompletions) -> None:
    fake.fault = "nan"
    out = run_probe(fake.base_url, "fake", _small_probe())
    assert out.logprobs[0][:3] == (None, None, pytest.approx(-0.3))
    r = compare(out, out)
    assert r.shared_tokens == 6 * 3 and r.mean_abs_logprob_diff == 0.0
    json.loads(out.model_dump_json())  # stays valid JSON for the cache


def test_run_probe_falls_back_to_token_ids_field(fake: FakeCompletions) -> None:
    fake.fault = "token_ids_field"
    out = run_probe(fake.base_url, "fake", _small_probe())
    assert len(out.token_ids[0]) == 5


@pytest.mark.parametrize("fault, match", [
    ("http500", "HTTP 500"),
    ("no_logprobs", "no logprobs"),
    ("text_tokens", "tokens as text"),
])
def test_run_probe_errors_are_engine_errors(fake: FakeCompletions, fault: str, match: str) -> None:
    fake.fault = fault
    with pytest.raises(EngineError, match=match):
        run_probe(fake.base_url, "fake", _small_probe(concurrency=3))


def test_run_probe_connection_refused() -> None:
    from autotune.engine import free_port

    with pytest.raises(EngineError, match="is the server still up"):
        run_probe(f"http://127.0.0.1:{free_port()}", "m", _small_probe())


def test_run_probe_inside_event_loop_says_use_await(fake: FakeCompletions) -> None:
    probe = _small_probe()

    async def inside() -> ProbeOutputs:
        with pytest.raises(AutotuneError, match="await arun_probe"):
            run_probe(fake.base_url, "fake", probe)
        return await arun_probe(fake.base_url, "fake", probe)

    assert len(asyncio.run(inside()).token_ids) == 6


# ---------------------------------------------------------------------------------------------
# the reference cache


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


@pytest.mark.parametrize("content", [
    "{not json", "", "[]", '{"format": 99}', '{"format": 1, "key": {}, "outputs": {}}',
])
def test_corrupted_cache_is_recomputed_with_a_warning(
    tmp_path: Path, fake: FakeCompletions, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    cache = ReferenceCache(tmp_path / "cache")
    probe = _small_probe()
    kw: dict[str, Any] = {"model": "m", "reference_flags": ["-O0"], "reference_env": {},
                          "probe": probe, "engine": "e"}
    key = cache.key(model="m", probe=probe, flags=["-O0"], env={}, engine="e")
    cache.directory.mkdir(parents=True)
    cache.path(key).write_text(content)
    starts: list[int] = []

    @contextmanager
    def start() -> Iterator[FakeCompletions]:
        starts.append(1)
        yield fake

    with caplog.at_level(logging.WARNING, logger="autotune.quality"):
        first = ensure_reference(cache, start_server=start, **kw)
    assert starts == [1]
    assert any("recomputing" in r.getMessage() for r in caplog.records)
    assert cache.load(key) == first
    again = ensure_reference(cache, start_server=start, **kw)  # now a hit: no server start
    assert again == first and starts == [1]


def test_unusable_cache_directory_is_a_clear_error(tmp_path: Path, fake: FakeCompletions) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(AutotuneError, match="cannot use the reference cache directory"):
        ensure_reference(ReferenceCache(tmp_path / "file" / "cache"), model="m",
                         reference_flags=[], reference_env=None, probe=_small_probe(),
                         start_server=lambda: fake, engine="e")


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


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness command


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


# ---------------------------------------------------------------------------------------------
# real vLLM (CPU build), tiny hybrid with random weights


_BASE_FLAGS = ["--max-model-len", "1024", "-O0", "--no-enable-prefix-caching"]
_REF_FLAGS = [*_BASE_FLAGS, "--mamba-ssm-cache-dtype", "float32", "--kv-cache-dtype", "auto"]
# Half the default probe (24 prompts x 128 tokens; CI time) with 8 in flight: on the CPU
# build the outputs do not depend on the batch (a concurrency-1 run gave the same bytes).
_SLOW_SPEC = QualitySpec(concurrency=8, n_prompts=24)


def _server(model: Path, flags: list[str], log: Path) -> Any:
    from autotune.engine import VllmServer

    return VllmServer(model=str(model), flags=flags, log_path=log,
                      start_timeout_s=float(os.environ.get("AUTOTUNE_TEST_START_TIMEOUT", "400")))


def _probe_on(model: Path, flags: list[str], probe: ProbeSet, log: Path) -> ProbeOutputs:
    (out,) = _probe_on_each(model, [(flags, log)], probe)
    return out


def _probe_on_each(model: Path, configs: list[tuple[list[str], Path]],
                   probe: ProbeSet) -> list[ProbeOutputs]:
    """One fresh server per (flags, log), all started at once (a start is mostly one
    process importing: two of them overlap on two cores), then probed one at a time."""
    servers = [_server(model, flags, log) for flags, log in configs]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_healthy()
        return [run_probe(s.base_url, s.served_model_name, probe) for s in servers]
    finally:
        for server in servers:
            server.stop()


def _cpu_has_fp8_kv() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f" in flags or " amx_tile" in flags


@pytest.fixture(scope="module")
def hybrid_reference(tiny_hybrid: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> tuple[ProbeSet, ProbeOutputs, ReferenceCache]:
    tmp = tmp_path_factory.mktemp("quality")
    probe = build_probe(SHAPE, vocab_size=VOCAB, spec=_SLOW_SPEC, max_model_len=1024)
    cache = ReferenceCache(tmp / "cache")
    ref = ensure_reference(cache, model=tiny_hybrid, reference_flags=_REF_FLAGS,
                           reference_env={}, probe=probe,
                           start_server=lambda: _server(tiny_hybrid, _REF_FLAGS, tmp / "ref.log"))
    return probe, ref, cache


@needs_vllm
@pytest.mark.slow
def test_reference_is_cached(tiny_hybrid: Path, hybrid_reference: Any) -> None:
    probe, ref, cache = hybrid_reference

    def must_not_start() -> Any:
        raise AssertionError("the cached reference should have been used")

    again = ensure_reference(cache, model=tiny_hybrid, reference_flags=_REF_FLAGS,
                             reference_env={}, probe=probe, start_server=must_not_start)
    assert again == ref
    assert all(len(t) == 128 for t in ref.token_ids)
    assert all(x is not None and x <= 0 for lp in ref.logprobs for x in lp)


@needs_vllm
@pytest.mark.slow
def test_rerun_agrees_far_better_than_lossy_state(
    tiny_hybrid: Path, hybrid_reference: Any, tmp_path: Path
) -> None:
    probe, ref, _ = hybrid_reference
    t0 = time.monotonic()
    lossy_flags = [*_BASE_FLAGS, "--mamba-ssm-cache-dtype", "bfloat16", "--kv-cache-dtype", "auto"]
    # two fresh starts (the reference config again, the lossy one), started side by side
    same_out, lossy_out = _probe_on_each(
        tiny_hybrid, [(_REF_FLAGS, tmp_path / "same.log"), (lossy_flags, tmp_path / "bf16.log")],
        probe)
    same, lossy = compare(ref, same_out), compare(ref, lossy_out)
    logging.getLogger(__name__).warning(
        "quality figures (%.0f s): rerun %s; bf16 state %s", time.monotonic() - t0,
        same.model_dump(), lossy.model_dump())
    assert same.exact_match_rate == 1.0
    assert same.mean_abs_logprob_diff is not None and same.mean_abs_logprob_diff <= 1e-6
    # greedy tokens may agree on most prompts (the CPU build's BF16 state drifts little:
    # 23 of 24 prompts identical in one run, all 24 in another); the log-probabilities show
    # the drift every time
    assert lossy.exact_match_rate <= same.exact_match_rate
    assert lossy.first_divergence_mean <= same.first_divergence_mean
    assert lossy.mean_abs_logprob_diff is not None and lossy.mean_abs_logprob_diff > 1e-5
    assert lossy.mean_abs_logprob_diff > 20 * max(same.mean_abs_logprob_diff, 1e-7)
    gate = parse_quality("max_logprob_diff=1e-5")
    assert quality_violation(same, gate) == 0.0 and quality_violation(lossy, gate) > 0.0


@needs_vllm
@pytest.mark.slow
@pytest.mark.skipif(not _cpu_has_fp8_kv(),
                    reason="the CPU build serves an FP8 KV cache only on x86 with AVX-512 or AMX")
def test_fp8_kv_cache_drifts(tiny_hybrid: Path, hybrid_reference: Any, tmp_path: Path) -> None:
    probe, ref, _ = hybrid_reference
    flags = [*_BASE_FLAGS, "--mamba-ssm-cache-dtype", "float32", "--kv-cache-dtype", "fp8_e4m3"]
    lossy = compare(ref, _probe_on(tiny_hybrid, flags, probe, tmp_path / "fp8.log"))
    logging.getLogger(__name__).warning("quality figures: fp8 KV %s", lossy.model_dump())
    assert lossy.mean_abs_logprob_diff is not None and lossy.mean_abs_logprob_diff > 1e-5
