"""Running the probe on one server: greedy completions with per-token logprobs."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, model_validator

from autotune.errors import AutotuneError, EngineError
from autotune.load import _http
from autotune.quality._probe import ProbeSet

logger = logging.getLogger(__name__)

_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")
_DETAIL_MAX: Final = 300


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


def _finite(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _parse_choice(body: Mapping[str, Any], i: int,
                  url: str) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
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
    url = base_url.rstrip("/") + "/v1/completions"
    timeout_s = request_timeout_s or probe.request_timeout_s
    limit = concurrency or probe.concurrency
    sem = asyncio.Semaphore(limit)
    # its own threads: the default pool (cores + 4) would cap the probe's concurrency
    pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="quality-probe")
    loop = asyncio.get_running_loop()
    server_ids: set[str] = set()

    async def one(i: int, prompt: tuple[int, ...]) -> Any:
        payload = {
            "model": model, "prompt": list(prompt), "max_tokens": probe.output_tokens,
            "temperature": 0.0, "logprobs": 1, "return_tokens_as_token_ids": True,
            "ignore_eos": probe.ignore_eos, "stream": False,
        }  # fmt: skip
        async with sem:
            try:
                resp = await loop.run_in_executor(
                    pool, functools.partial(_http.post_json, url, payload, timeout_s=timeout_s))
            except _http.HttpError as exc:
                raise EngineError(
                    f"quality probe: request {i} to {url} failed ({exc}); is the server "
                    "still up?"
                ) from exc
        text = resp.text
        if resp.status != 200:
            raise EngineError(
                f"quality probe: {url} answered HTTP {resp.status} to prompt {i} "
                f"({len(prompt)} tokens): {text[:_DETAIL_MAX]}"
            )
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
    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(probe.prompts)]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # retrieve every outcome
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
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
