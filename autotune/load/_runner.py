"""One run's shared state and its requests: send one streaming request, record what came
back, and tell the run's hooks (:mod:`autotune.load._hooks`) that it finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autotune.load._http1 import Pool, RequestFailure, short
from autotune.load._records import _HEADERS, Api, RequestRecord
from autotune.load._sse import _body, _SseParser

if TYPE_CHECKING:
    from autotune.load._hooks import Hook
    from autotune.traffic import RequestSpec


class _Runner:
    """State shared by all requests of one run: what is in flight, the counts so far, and
    how the run ends (the sends stopped, aborted, interrupted); the hooks set the latter."""

    def __init__(
        self,
        pool: Pool,
        *,
        path: str,
        model: str,
        api: Api,
        request_timeout_s: float,
        stall_timeout_s: float,
        t0: float,
        hooks: Sequence[Hook] = (),
    ) -> None:
        self.pool = pool
        self.path = path
        self.model = model
        self.api = api
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.t0 = t0
        self.hooks = tuple(hooks)
        self.done = 0
        self.live: dict[_SseParser, float] = {}  # parsers of requests in flight: send time
        self.tokens_done = 0  # output tokens of finished successful requests
        self.failed = 0
        self.stopped_at: float | None = None  # no more sends from this time on
        self.aborted: str | None = None
        self.stop = asyncio.Event()  # the run ends now: what is in flight is cancelled
        self.interrupted_at: float | None = None
        self.complete_before: float | None = None

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.monotonic() - self.t0

    def tokens(self) -> int:
        """Output tokens received so far by successful or in-flight requests."""
        return self.tokens_done + sum(p.cum for p in self.live)

    def abort_with(self, why: str) -> None:
        """End the run now with ``why`` (the first reason given wins)."""
        if self.aborted is None:
            self.aborted = why
            self.stop.set()

    def _finished(self, rec: RequestRecord) -> None:
        self.done += 1
        if rec.error is not None:
            self.failed += 1
        for hook in self.hooks:
            hook.finished(self, rec)

    async def request(self, spec: RequestSpec, ids: list[int] | None = None) -> RequestRecord:
        """Send one streaming request and record what came back; ``ids`` (a list) collects
        the generated token ids (completions API: the server is asked for them)."""
        body = _body(spec, self.model, self.api, token_ids=ids is not None)
        head = self.pool.target.post_head(self.path, len(body), _HEADERS)
        t0 = self.t0
        clock = time.monotonic
        sse = _SseParser(chat=self.api == "chat", ids=ids)
        status: int | None = None
        send = clock() - t0
        self.live[sse] = send
        try:
            status = await self.pool.request(
                head + body,
                sse.feed,
                timeout_s=self.request_timeout_s,
                stall_s=self.stall_timeout_s,
            )
            sse.close()
        except RequestFailure as f:
            status = f.status if f.status is not None else status
            return self._record(spec, send, clock() - t0, sse, status, f.reason, f.detail)
        except OSError as exc:
            detail = short(f"{type(exc).__name__}: {exc}")
            return self._record(spec, send, clock() - t0, sse, status, "client_error", detail)
        return self._record(spec, send, clock() - t0, sse, status, None, None)

    def _record(
        self,
        spec: RequestSpec,
        send: float,
        end: float,
        sse: _SseParser,
        status: int | None,
        error: str | None,
        detail: str | None,
    ) -> RequestRecord:
        self.live.pop(sse, None)
        if error is None:
            self.tokens_done += sse.cum
        times = sse.times
        usage_total = sse.usage_total
        rec = RequestRecord(
            index=spec.index,
            send_s=send,
            first_token_s=times[0] if times else None,
            end_s=end,
            chunk_times_s=tuple(times),
            chunk_tokens=tuple(sse.tokens),
            prompt_tokens=sse.prompt_tokens,
            output_tokens=(
                usage_total if usage_total is not None and error is None else sum(sse.tokens)
            ),
            ok=error is None,
            error=error,
            detail=detail,
            status=status,
            sent_prompt_tokens=len(spec.prompt_token_ids),
        )
        self._finished(rec)
        return rec
