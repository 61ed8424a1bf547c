"""Quality gate for lossy knobs: a fixed greedy probe compared with a full-precision reference.

Some knobs buy speed with accuracy (an FP16/BF16 Mamba SSM state, an FP8 KV cache). A trial
whose config sets such a knob (``lossy: true`` in the search space) away from its reference
value runs a small, seeded probe on its own server after the measurement: greedy
continuations with per-token logprobs of a fixed prompt set, compared with the same prompts
on the *reference* config (the study's defaults with every lossy knob at its full-precision
default and no speculation), computed once per study and cached on disk.

The pieces, in the order a study uses them:

* :class:`QualitySpec` and :func:`build_probe`: the deterministic prompt set (:class:`ProbeSet`);
* :func:`reference_params`: the knob values of the reference config of a search space;
* :class:`ReferenceCache` and :func:`ensure_reference`: the reference outputs, cached;
* :func:`run_probe` (:func:`arun_probe` inside an event loop): one server's outputs;
* :func:`compare`: reference vs candidate -> :class:`QualityReport` (``.flat()`` for metrics);
* :func:`parse_quality` and :func:`quality_violation`: user thresholds -> an Optuna
  constraint value (> 0 = violated);
* :func:`lm_eval_command`: an lm-evaluation-harness command to score a config's server on
  real tasks (real weights only). See docs/quality.md.

This is a numerical-drift probe, not an accuracy benchmark: it says how often and how early
a lossy config's greedy output leaves the reference's, which is what can be measured with
random weights and random prompts. Real accuracy needs real weights and real tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from autotune.errors import AutotuneError, ConfigError, EngineError, SpaceError

if TYPE_CHECKING:
    from autotune.space import SearchSpace
    from autotune.traffic import TrafficShape

__all__ = [
    "QUALITY_KEYS",
    "ProbeOutputs",
    "ProbeServer",
    "ProbeSet",
    "QualityReport",
    "QualitySpec",
    "QualityThresholds",
    "ReferenceCache",
    "ReferenceKey",
    "arun_probe",
    "build_probe",
    "compare",
    "ensure_reference",
    "lm_eval_command",
    "model_fingerprint",
    "parse_quality",
    "quality_violation",
    "reference_params",
    "run_probe",
]

logger = logging.getLogger(__name__)

_CACHE_FORMAT: Final = 1
_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")
_DETAIL_MAX: Final = 300

#: Threshold keys of :func:`parse_quality` and what each bounds.
QUALITY_KEYS: Final[dict[str, str]] = {
    "min_agreement": "least share of prompts whose greedy continuation equals the "
    "reference's exactly (0..1)",
    "max_logprob_diff": "largest mean |logprob difference| on the shared prefix (nats, >= 0)",
    "min_divergence_p10": "least 10th percentile of the first-divergence position (tokens)",
}


# ---------------------------------------------------------------------------------------------
# The probe


class QualitySpec(BaseModel):
    """How the probe is made and sent (validated once; frozen).

    The defaults send 48 prompts of at most 256 tokens and decode 128 tokens each.
    ``concurrency`` is how many probe requests are in flight at once. 1 (the default) keeps
    every request alone in the engine, so the outputs do not depend on batch composition,
    which varies from run to run and would add noise that is not the lossy knob's doing.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_prompts: int = Field(default=48, ge=1, le=4096)
    max_input_tokens: int = Field(default=256, ge=1)
    # 128, not 32: a lossy recurrent state drifts step by step, so greedy outputs part late
    # (tiny hybrid, BF16 state: no prompt diverged within 32 tokens, 16-27 % within 128).
    output_tokens: int = Field(default=128, ge=1, le=4096)
    seed: int = Field(default=0, ge=0)
    ignore_eos: bool = True  # every prompt yields output_tokens positions to compare
    concurrency: int = Field(default=1, ge=1, le=256)
    request_timeout_s: float = Field(default=300.0, gt=0)


class ProbeSet(BaseModel):
    """A fixed prompt set (token ids) and how to decode it; :attr:`digest` identifies it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompts: tuple[tuple[int, ...], ...] = Field(min_length=1)
    output_tokens: int = Field(ge=1)
    ignore_eos: bool = True
    concurrency: int = Field(default=1, ge=1)
    request_timeout_s: float = Field(default=300.0, gt=0)
    seed: int = 0
    shape_fingerprint: str = ""

    @property
    def digest(self) -> str:
        """sha256 of everything that decides the outputs (prompts, length, EOS, batching)."""
        blob = json.dumps(
            {"prompts": self.prompts, "output_tokens": self.output_tokens,
             "ignore_eos": self.ignore_eos, "concurrency": self.concurrency},
            separators=(",", ":"),
        )  # fmt: skip
        return hashlib.sha256(blob.encode()).hexdigest()


def build_probe(
    shape: TrafficShape,
    *,
    vocab_size: int,
    spec: QualitySpec | None = None,
    max_model_len: int | None = None,
    text_model: str | Path | None = None,
) -> ProbeSet:
    """The probe's prompt set for ``shape`` (deterministic: same arguments, same prompts).

    Input lengths are drawn from the shape (with its prefix sharing) and capped at
    ``spec.max_input_tokens`` and, when given, ``max_model_len - spec.output_tokens``.
    ``text_model`` (a real checkpoint's folder): the prompts are real text of those lengths,
    tokenized with its tokenizer (:func:`autotune.prompts.text_prompts`), not random ids.
    """
    from autotune.traffic import build_schedule

    spec = spec or QualitySpec()
    max_in = spec.max_input_tokens
    if max_model_len is not None:
        room = max_model_len - spec.output_tokens
        if room < 1:
            raise ConfigError(
                f"quality probe: max_model_len {max_model_len} leaves no room for a prompt "
                f"before {spec.output_tokens} output tokens; lower output_tokens"
            )
        max_in = min(max_in, room)
    schedule = build_schedule(
        shape, vocab_size=vocab_size, seed=spec.seed, mode="closed", concurrency=1,
        num_requests=spec.n_prompts, max_input_tokens=max_in,
        max_output_tokens=spec.output_tokens,
    )  # fmt: skip
    prompts = tuple(r.prompt_token_ids for r in schedule.requests)
    if text_model is not None:
        from autotune.prompts import text_prompts

        prompts = text_prompts(text_model, [len(p) for p in prompts], seed=spec.seed)
    return ProbeSet(
        prompts=prompts,
        output_tokens=spec.output_tokens,
        ignore_eos=spec.ignore_eos,
        concurrency=spec.concurrency,
        request_timeout_s=spec.request_timeout_s,
        seed=spec.seed,
        shape_fingerprint=shape.fingerprint,
    )


class ProbeOutputs(BaseModel):
    """One server's greedy continuations of a probe: token ids and their logprobs.

    ``logprobs[i][j]`` is the logprob of ``token_ids[i][j]``; None where the server gave a
    non-finite value (JSON has no NaN).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    probe_digest: str
    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float | None, ...], ...]
    wall_s: float = 0.0
    server: str = ""  # system_fingerprint or engine version the server reported

    @model_validator(mode="after")
    def _same_lengths(self) -> ProbeOutputs:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"{len(self.token_ids)} token lists but {len(self.logprobs)} logprob lists"
            )
        for i, (t, lp) in enumerate(zip(self.token_ids, self.logprobs, strict=True)):
            if len(t) != len(lp):
                raise ValueError(f"prompt {i}: {len(t)} tokens but {len(lp)} logprobs")
        return self


# ---------------------------------------------------------------------------------------------
# Running the probe against a server


def _finite(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _parse_choice(body: Mapping[str, Any], i: int, url: str) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
    """Token ids and logprobs of one /v1/completions answer (raises EngineError if unusable)."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise EngineError(
            f"quality probe: {url} answered prompt {i} without choices: "
            f"{json.dumps(body)[:_DETAIL_MAX]}"
        ) from None
    lp = choice.get("logprobs") if isinstance(choice, Mapping) else None
    if not isinstance(lp, Mapping) or not isinstance(lp.get("token_logprobs"), list):
        raise EngineError(
            f"quality probe: {url} returned no logprobs for prompt {i}; the probe asks for "
            "'logprobs: 1', which vLLM serves unless --max-logprobs is 0"
        )
    logprobs = tuple(_finite(x) for x in lp["token_logprobs"])
    tokens = lp.get("tokens")
    ids: list[int] = []
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        for t in tokens:
            m = _TOKEN_ID.match(t)
            if m is None:
                break
            ids.append(int(m.group(1)))
        else:
            if len(ids) != len(logprobs):
                raise EngineError(
                    f"quality probe: {url} returned {len(ids)} tokens but {len(logprobs)} "
                    f"logprobs for prompt {i}"
                )
            return tuple(ids), logprobs
    raw_ids = choice.get("token_ids")
    if isinstance(raw_ids, list) and all(isinstance(t, int) for t in raw_ids):
        if len(raw_ids) != len(logprobs):
            raise EngineError(
                f"quality probe: {url} returned {len(raw_ids)} token ids but "
                f"{len(logprobs)} logprobs for prompt {i}"
            )
        return tuple(raw_ids), logprobs
    raise EngineError(
        f"quality probe: {url} returned tokens as text ({str(tokens)[:80]}) for prompt {i}; "
        "the probe needs token ids ('return_tokens_as_token_ids', vLLM >= 0.6)"
    )


async def arun_probe(
    base_url: str,
    model: str,
    probe: ProbeSet,
    *,
    concurrency: int | None = None,
    request_timeout_s: float | None = None,
) -> ProbeOutputs:
    """Send every probe prompt to ``base_url``'s ``/v1/completions``, greedy, with logprobs.

    ``concurrency`` and ``request_timeout_s`` default to the probe's. Raises
    :class:`EngineError` when a request fails or an answer lacks token ids or logprobs.
    """
    import aiohttp

    url = base_url.rstrip("/") + "/v1/completions"
    limit = concurrency or probe.concurrency
    timeout = aiohttp.ClientTimeout(total=request_timeout_s or probe.request_timeout_s)
    sem = asyncio.Semaphore(limit)
    server_ids: set[str] = set()

    async def one(session: aiohttp.ClientSession, i: int, prompt: tuple[int, ...]) -> Any:
        payload = {
            "model": model, "prompt": list(prompt), "max_tokens": probe.output_tokens,
            "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "ignore_eos": probe.ignore_eos, "stream": False,
        }  # fmt: skip
        async with sem:
            try:
                async with session.post(url, json=payload) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise EngineError(
                            f"quality probe: {url} answered HTTP {resp.status} to prompt {i} "
                            f"({len(prompt)} tokens): {text[:_DETAIL_MAX]}"
                        )
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise EngineError(
                    f"quality probe: request {i} to {url} failed ({type(exc).__name__}: "
                    f"{exc}); is the server still up?"
                ) from exc
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            raise EngineError(
                f"quality probe: {url} answered prompt {i} with non-JSON: {text[:_DETAIL_MAX]}"
            ) from None
        if isinstance(body, Mapping) and isinstance(body.get("system_fingerprint"), str):
            server_ids.add(body["system_fingerprint"])
        return _parse_choice(body, i, url)

    t0 = time.monotonic()
    connector = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(one(session, i, p)) for i, p in enumerate(probe.prompts)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # retrieve every outcome
            raise
    return ProbeOutputs(
        probe_digest=probe.digest,
        token_ids=tuple(r[0] for r in results),
        logprobs=tuple(r[1] for r in results),
        wall_s=round(time.monotonic() - t0, 3),
        server=",".join(sorted(server_ids)),
    )


def run_probe(
    base_url: str,
    model: str,
    probe: ProbeSet,
    *,
    concurrency: int | None = None,
    request_timeout_s: float | None = None,
) -> ProbeOutputs:
    """Synchronous :func:`arun_probe` (call it from a thread without a running event loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise AutotuneError(
            "run_probe() was called inside a running event loop; use 'await arun_probe(...)'"
        )
    return asyncio.run(
        arun_probe(base_url, model, probe, concurrency=concurrency,
                   request_timeout_s=request_timeout_s)
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Comparing outputs


class QualityReport(BaseModel):
    """How far a candidate's greedy outputs are from the reference's.

    ``exact_match_rate``: share of prompts whose continuation is identical (same tokens,
    same length). ``first_divergence_*``: per prompt, the index of the first differing
    token (a prompt that matches exactly counts its full length; one that is a prefix of
    the other diverges where the shorter ends). ``mean_abs_logprob_diff``: mean
    |logprob_ref - logprob_candidate| over the tokens before each prompt's first divergence
    (None when there is no such token with finite logprobs on both sides).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_prompts: int
    exact_match_rate: float
    first_divergence_mean: float
    first_divergence_p10: float
    mean_abs_logprob_diff: float | None
    max_abs_logprob_diff: float | None
    output_tokens: float  # mean reference continuation length (what divergence is out of)
    shared_tokens: int  # tokens that entered the logprob difference

    def flat(self) -> dict[str, float]:
        """Finite figures as floats named ``quality_<field>`` (trial metrics, MLflow)."""
        out = {f"quality_{k}": v for k, v in self.model_dump().items()}
        return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}


def compare(reference: ProbeOutputs, candidate: ProbeOutputs) -> QualityReport:
    """Compare ``candidate`` with ``reference`` (outputs of the same probe)."""
    if reference.probe_digest != candidate.probe_digest:
        raise AutotuneError(
            f"quality: the outputs come from different probes (reference "
            f"{reference.probe_digest[:12]}, candidate {candidate.probe_digest[:12]}); run "
            "the candidate with the probe the reference was made with"
        )
    n = len(reference.token_ids)
    if n == 0 or len(candidate.token_ids) != n:
        raise AutotuneError(
            f"quality: cannot compare {len(candidate.token_ids)} candidate outputs with "
            f"{n} reference outputs; both need the same, non-zero number of prompts"
        )
    exact = 0
    div: list[int] = []
    diffs: list[float] = []
    for ra, ca, rl, cl in zip(reference.token_ids, candidate.token_ids, reference.logprobs,
                              candidate.logprobs, strict=True):  # fmt: skip
        m = min(len(ra), len(ca))
        d = next((j for j in range(m) if ra[j] != ca[j]), m)
        div.append(d)
        exact += int(d == len(ra) == len(ca))
        for j in range(d):
            a, b = rl[j], cl[j]
            if a is not None and b is not None:
                diffs.append(abs(a - b))
    d_arr = np.asarray(div, dtype=np.float64)
    return QualityReport(
        n_prompts=n,
        exact_match_rate=exact / n,
        first_divergence_mean=float(d_arr.mean()),
        first_divergence_p10=float(np.percentile(d_arr, 10)),
        mean_abs_logprob_diff=float(np.mean(diffs)) if diffs else None,
        max_abs_logprob_diff=float(np.max(diffs)) if diffs else None,
        output_tokens=float(np.mean([len(t) for t in reference.token_ids])),
        shared_tokens=len(diffs),
    )


# ---------------------------------------------------------------------------------------------
# Thresholds


class QualityThresholds(BaseModel):
    """Bounds a config must meet (None = not bounded); see :data:`QUALITY_KEYS`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_agreement: float | None = Field(default=None, ge=0, le=1)
    max_logprob_diff: float | None = Field(default=None, ge=0)
    min_divergence_p10: float | None = Field(default=None, ge=0)

    def is_empty(self) -> bool:
        return all(v is None for v in self.model_dump().values())


def parse_quality(text: str) -> QualityThresholds:
    """Parse ``"min_agreement=0.95,max_logprob_diff=0.05"`` (comma- or space-separated).

    Keys: see :data:`QUALITY_KEYS`. Raises :class:`ConfigError` naming the bad part.
    """
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise ConfigError(
            f"--quality {text!r} is empty; give KEY=VALUE pairs such as "
            "'min_agreement=0.95' (keys: " + ", ".join(QUALITY_KEYS) + ")"
        )
    values: dict[str, float] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise ConfigError(f"--quality: {part!r} is not KEY=VALUE (e.g. 'min_agreement=0.95')")
        if key not in QUALITY_KEYS:
            raise ConfigError(
                f"--quality: unknown key {key!r}; use one of " + ", ".join(QUALITY_KEYS)
            )
        if key in values:
            raise ConfigError(f"--quality: {key!r} is given twice; give each key once")
        try:
            v = float(raw)
        except ValueError:
            raise ConfigError(f"--quality: {key}={raw!r} is not a number") from None
        if not math.isfinite(v):
            raise ConfigError(f"--quality: {key}={raw!r} must be a finite number")
        values[key] = v
    try:
        return QualityThresholds(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err.get("loc") else "?"
        raise ConfigError(
            f"--quality: {key}={values.get(key)!r} is out of range ({err['msg']}); "
            f"{key} is the {QUALITY_KEYS.get(key, key)}"
        ) from None


def quality_violation(report: QualityReport, thresholds: QualityThresholds) -> float:
    """An Optuna constraint value: 0 when every bound holds, else the summed shortfall (> 0).

    Shortfalls are relative to each bound, so the magnitudes add up: e.g. an agreement of
    0.80 against ``min_agreement=0.95`` gives 0.158. A logprob bound with no shared token to
    measure (every prompt diverged at once) counts as violated by 1.
    """
    v = 0.0
    t = thresholds
    if t.min_agreement is not None and report.exact_match_rate < t.min_agreement:
        v += (t.min_agreement - report.exact_match_rate) / max(t.min_agreement, 1e-9)
    if t.max_logprob_diff is not None:
        diff = report.mean_abs_logprob_diff
        if diff is None:
            v += 1.0
        elif diff > t.max_logprob_diff:
            v += (diff - t.max_logprob_diff) / max(t.max_logprob_diff, 1e-3)
    if t.min_divergence_p10 is not None and report.first_divergence_p10 < t.min_divergence_p10:
        v += (t.min_divergence_p10 - report.first_divergence_p10) / max(t.min_divergence_p10, 1e-9)
    return float(v)


# ---------------------------------------------------------------------------------------------
# The reference


def reference_params(space: SearchSpace, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Knob values of the reference config: ``params`` (default: the space's baseline values)
    with every active lossy knob at its ``default`` (its full-precision value).

    Launch it with ``space.launch_spec(reference_params(space))``. Raises
    :class:`SpaceError` when an active lossy knob has no ``default``.
    """
    out = dict(space.baseline_params() if params is None else params)
    for name, knob in space.knobs.items():
        if not knob.lossy:
            continue
        if not space.is_active(name, out):
            out.pop(name, None)
            continue
        if knob.default is None:
            raise SpaceError(
                f"search space {space.name}: knob {name!r} is lossy but has no 'default'; "
                "the quality reference needs its full-precision value (e.g. default: float32)"
            )
        out[name] = knob.default
    return out


def model_fingerprint(model: str | os.PathLike[str]) -> str:
    """A short id of a model: for a local directory, its config and the names, sizes and
    modification times of its files; otherwise the name itself."""
    p = Path(model)
    h = hashlib.sha256()
    if p.is_dir():
        h.update(str(p.resolve()).encode())
        for f in sorted(p.iterdir()):
            if not f.is_file():
                continue
            st = f.stat()
            if f.suffix == ".json" and st.st_size < 5_000_000:
                h.update(f.name.encode() + b"\0" + f.read_bytes())
            else:
                h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    else:
        h.update(str(model).encode())
    return h.hexdigest()[:24]


class ReferenceKey(BaseModel):
    """What decides the reference outputs; :attr:`digest` names the cache file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    model_fingerprint: str
    probe_digest: str
    flags: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    engine: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


def _engine_id() -> str:
    try:
        from autotune.engine import detect_engine

        info = detect_engine()
    except AutotuneError:
        return ""
    return f"{info.package} {info.version}"


class ReferenceCache:
    """Reference outputs as JSON files under ``directory``, one per :class:`ReferenceKey`.

    Writes are atomic (temp file, then ``os.replace``); an unreadable or mismatching file
    is logged as a warning and treated as missing, so it is recomputed and replaced.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def key(
        self,
        *,
        model: str | os.PathLike[str],
        probe: ProbeSet,
        flags: Sequence[str],
        env: Mapping[str, str] | None = None,
        engine: str | None = None,
    ) -> ReferenceKey:
        """The key of a reference (``engine`` defaults to the installed vLLM's version)."""
        return ReferenceKey(
            model=str(model),
            model_fingerprint=model_fingerprint(model),
            probe_digest=probe.digest,
            flags=tuple(str(f) for f in flags),
            env=tuple(sorted((str(k), str(v)) for k, v in (env or {}).items())),
            engine=_engine_id() if engine is None else engine,
        )

    def path(self, key: ReferenceKey) -> Path:
        return self.directory / f"quality-reference-{key.digest[:20]}.json"

    def load(self, key: ReferenceKey) -> ProbeOutputs | None:
        """The cached outputs for ``key``, or None (missing, corrupted or stale)."""
        path = self.path(key)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            logger.warning("quality reference %s is unreadable (%s); recomputing it", path, exc)
            return None
        try:
            if not isinstance(raw, dict) or raw.get("format") != _CACHE_FORMAT:
                raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else raw!r}")
            if ReferenceKey.model_validate(raw["key"]) != key:
                raise ValueError("its key does not match")
            outputs = ProbeOutputs.model_validate(raw["outputs"])
        except (KeyError, ValueError, ValidationError) as exc:
            logger.warning("quality reference %s is not usable (%s); recomputing it", path,
                           str(exc).splitlines()[0])
            return None
        if outputs.probe_digest != key.probe_digest:
            logger.warning("quality reference %s holds another probe's outputs; recomputing", path)
            return None
        return outputs

    def save(self, key: ReferenceKey, outputs: ProbeOutputs) -> Path:
        """Write ``outputs`` for ``key`` atomically; returns the file's path."""
        if outputs.probe_digest != key.probe_digest:
            raise AutotuneError(
                "quality: these outputs are of another probe than the key says; not caching"
            )
        from autotune import __version__

        path = self.path(key)
        doc = {
            "format": _CACHE_FORMAT,
            "key": key.model_dump(mode="json"),
            "outputs": outputs.model_dump(mode="json"),
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "autotune_version": __version__,
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f, separators=(",", ":"))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as exc:
            raise AutotuneError(
                f"quality: cannot write the reference cache {path}: {exc}; check that "
                f"{self.directory} is writable"
            ) from exc
        return path

    @contextlib.contextmanager
    def lock(self, key: ReferenceKey) -> Iterator[None]:
        """Hold an exclusive file lock for ``key``: concurrent workers compute it once."""
        import fcntl

        lock_path = self.directory / f".{self.path(key).name}.lock"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            f = open(lock_path, "a")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise AutotuneError(
                f"quality: cannot use the reference cache directory {self.directory}: {exc}; "
                "make it writable or choose another cache directory"
            ) from exc
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class ProbeServer(Protocol):
    """What :func:`ensure_reference` needs of a started server (``VllmServer`` fits)."""

    @property
    def base_url(self) -> str: ...

    served_model_name: str


def ensure_reference(
    cache: ReferenceCache | None,
    *,
    model: str | os.PathLike[str],
    reference_flags: Sequence[str],
    reference_env: Mapping[str, str] | None,
    probe: ProbeSet,
    start_server: Callable[[], AbstractContextManager[ProbeServer]],
    engine: str | None = None,
) -> ProbeOutputs:
    """The reference outputs of ``probe``: from ``cache``, or computed on a server that
    ``start_server()`` starts (a context manager yielding a healthy server, stopped on exit)
    and then cached. ``cache=None`` always computes.

    ``start_server`` must serve ``model`` with ``reference_flags``/``reference_env`` (they
    only make the cache key). Errors of the server (start, crash) propagate: without a
    reference no lossy trial can be judged.
    """
    if cache is None:
        with start_server() as server:
            return run_probe(server.base_url, server.served_model_name, probe)
    key = cache.key(model=model, probe=probe, flags=reference_flags, env=reference_env,
                    engine=engine)  # fmt: skip
    with cache.lock(key):
        hit = cache.load(key)
        if hit is not None:
            logger.info("quality reference from cache %s", cache.path(key))
            return hit
        logger.info("computing the quality reference (%d prompts) with %s", len(probe.prompts),
                    " ".join(reference_flags))
        with start_server() as server:
            outputs = run_probe(server.base_url, server.served_model_name, probe)
        path = cache.save(key, outputs)
        logger.info("quality reference cached in %s (%.1f s)", path, outputs.wall_s)
        return outputs


# ---------------------------------------------------------------------------------------------
# lm-evaluation-harness (real weights)


def lm_eval_command(
    base_url: str,
    model: str,
    tasks: Sequence[str],
    *,
    tokenizer: str | None = None,
    num_concurrent: int = 8,
    max_retries: int = 3,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    max_length: int | None = None,
    output_path: str | None = None,
    seed: int = 0,
    extra_model_args: Mapping[str, Any] | None = None,
    executable: str = "lm_eval",
) -> list[str]:
    """An ``lm_eval`` argv scoring the server at ``base_url`` (serving ``model``) on ``tasks``
    through its OpenAI-compatible ``/v1/completions`` endpoint.

    ``tokenizer`` is a local tokenizer path or hub name for lm-eval's own token counting
    (default: ``model``; use the model directory the server loaded). ``limit`` caps samples
    per task (an int, or a fraction < 1) for a quick comparison; ``max_length`` is the
    context lm-eval may fill (its default is 2048; give the server's --max-model-len). Requests
    go as token ids (lm-eval's default), so both sides tokenize alike. lm-eval is not a dependency:
    ``pip install 'lm-eval[api]'``. See docs/quality.md.
    """
    if not tasks or any(not t or "," in t or t.strip() != t for t in tasks):
        raise ConfigError(
            f"lm_eval tasks {list(tasks)!r}: give one or more task names without commas or "
            "spaces, e.g. ['gsm8k', 'arc_easy']"
        )
    if num_concurrent < 1 or max_retries < 0 or batch_size < 1:
        raise ConfigError(
            f"lm_eval: num_concurrent ({num_concurrent}) and batch_size ({batch_size}) must be "
            f">= 1 and max_retries ({max_retries}) >= 0"
        )
    args: dict[str, Any] = {
        "base_url": base_url.rstrip("/") + "/v1/completions",
        "model": model,
        "tokenizer": tokenizer or model,
        "tokenizer_backend": "huggingface",
        "num_concurrent": num_concurrent,
        "max_retries": max_retries,
    }
    if max_length is not None:
        args["max_length"] = max_length
    for k, v in (extra_model_args or {}).items():
        args[str(k)] = v
    for k, v in args.items():
        if any(c in str(v) for c in ",="):
            raise ConfigError(
                f"lm_eval model arg {k}={v!r} contains ',' or '=', which lm-eval's "
                "--model_args cannot carry; use a path or name without them"
            )
    model_args = ",".join(f"{k}={_arg(v)}" for k, v in args.items())
    cmd = [executable, "--model", "local-completions", "--model_args", model_args,
           "--tasks", ",".join(tasks), "--batch_size", str(batch_size), "--seed", str(seed)]
    if limit is not None:
        if not (limit > 0):
            raise ConfigError(f"lm_eval limit {limit!r} must be > 0 (a count, or a fraction < 1)")
        cmd += ["--limit", f"{limit:g}" if isinstance(limit, float) else str(limit)]
    if num_fewshot is not None:
        if num_fewshot < 0:
            raise ConfigError(f"lm_eval num_fewshot {num_fewshot} must be >= 0")
        cmd += ["--num_fewshot", str(num_fewshot)]
    if output_path is not None:
        cmd += ["--output_path", output_path]
    return cmd


def _arg(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    return str(v)
