"""Streaming OpenAI-compatible load generator: runs a replay schedule, records every request.

A pool of keep-alive HTTP/1.1 connections (:mod:`autotune.load`, as many as requests in
flight) drives ``/v1/completions`` (token-id prompts) or ``/v1/chat/completions``
(the request's ``prompt`` text, built with the model's tokenizer by :mod:`autotune.load`;
else ``t<id>`` words, one token each for our tiny models) with ``stream: true``,
``ignore_eos: true``, ``temperature: 0`` and continuous usage stats, so each SSE chunk
says how many tokens it carried (speculative decoding puts several in one chunk).

The hot path is one protocol callback per socket read: one clock read, the HTTP chunk
framing stripped, SSE lines split with ``bytes.split`` and only the needed fields decoded
with a typed msgspec decoder. A failed request is data: its :class:`RequestRecord` has
``ok=False`` and an ``error`` reason from :data:`ERROR_REASONS`; the run always completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from autotune.errors import LoadgenError
from autotune.load._http1 import Pool, RequestFailure, Target, short
from autotune.load._server_metrics import ServerSnapshot, fetch_metrics_text, parse_metrics

if TYPE_CHECKING:
    import threading

    from autotune.traffic import RequestSpec, Schedule
from autotune.load._records import (
    _HEADERS,
    _PATHS,
    Abort,
    Api,
    RequestRecord,
    RunResult,
    SegmentControl,
    staggered,
)
from autotune.load._sse import _body, _SseParser

logger = logging.getLogger(__name__)


class _Runner:
    """State shared by all requests of one run."""

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
        total: int,
        progress: Callable[[int, int], None] | None,
        abort: Abort | None = None,
    ) -> None:
        self.pool = pool
        self.path = path
        self.model = model
        self.api = api
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.t0 = t0
        self.total = total
        self.progress = progress
        self.done = 0
        self.live: dict[_SseParser, float] = {}  # parsers of requests in flight: send time
        self.tokens_done = 0  # output tokens of finished successful requests
        self.failed = 0
        self.control: SegmentControl | None = None
        self.stopped_at: float | None = None
        self._next_boundary = 0
        self.abort = abort
        self.aborted: str | None = None
        self.stop = asyncio.Event()
        self.interrupted_at: float | None = None
        self.complete_before: float | None = None

    async def tick(self, every_s: float = 1.0) -> None:
        """Ask the abort hook's ``tick(now)`` once every ``every_s`` (see :data:`Abort`)."""
        tick = getattr(self.abort, "tick", None)
        while tick is not None and not self.stop.is_set():
            await asyncio.sleep(every_s)
            if self.aborted is None:
                why = tick(time.monotonic() - self.t0)
                if why:
                    self.aborted = why
                    self.stop.set()

    async def watch(self, interrupt: threading.Event, every_s: float = 0.1) -> None:
        """Stop the run as soon as ``interrupt`` is set: no more sends, the requests in
        flight cancelled (waiting for them could take a whole request's duration)."""
        while not self.stop.is_set():
            if interrupt.is_set():
                now = time.monotonic() - self.t0
                self.interrupted_at = now
                self.complete_before = min(self.live.values(), default=now)
                if self.stopped_at is None:
                    self.stopped_at = now
                self.stop.set()
                return
            await asyncio.sleep(every_s)

    def _finished(self, rec: RequestRecord) -> None:
        self.done += 1
        if rec.error is not None:
            self.failed += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        control = self.control
        if control is not None and self.stopped_at is None and self.done >= self._next_boundary:
            self._next_boundary = self.done + max(1, control.segment_requests)
            if self.done > 0:
                now = time.monotonic() - self.t0
                tokens = self.tokens_done + sum(p.cum for p in self.live)
                if control.on_segment(now, tokens, self.failed):
                    self.stopped_at = now
        if self.abort is not None and self.aborted is None:
            why = self.abort(rec, self.done, self.failed)
            if why:
                self.aborted = why
                self.stop.set()

    async def request(self, spec: RequestSpec) -> RequestRecord:
        """Send one streaming request and record what came back."""
        body = _body(spec, self.model, self.api)
        head = self.pool.target.post_head(self.path, len(body), _HEADERS)
        t0 = self.t0
        clock = time.monotonic
        sse = _SseParser(chat=self.api == "chat")
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


@contextlib.contextmanager
def _gc_relaxed() -> Iterator[None]:
    """Keep the cyclic GC out of the hot path while a run is in flight.

    Everything that exists is moved to the permanent generation and young collections
    happen 100x less often: a full collection over millions of chunk timestamps would
    otherwise pause every stream at once (it cost ~10 % of the client's CPU at 1,024
    streams). The thresholds are restored afterwards.
    """
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(old[0], 1) * 100, old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def _raise_nofile(need: int) -> None:
    """Lift the soft open-files limit so ``need`` sockets fit (up to the hard limit)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit to %d: %s", need, exc)
            return
        if new < need:
            logger.warning(
                "open-files hard limit is %d but %d streams need about %d; raise it "
                "(ulimit -Hn) or lower the concurrency",
                hard,
                need - 64,
                need,
            )


def _check(
    schedule: Schedule,
) -> tuple[Literal["open", "closed"], int | None, Sequence[RequestSpec]]:
    mode = getattr(schedule, "mode", None)
    requests = getattr(schedule, "requests", None)
    conc = getattr(schedule, "concurrency", None)
    if mode not in ("open", "closed") or requests is None:
        raise LoadgenError(
            f"not a replay schedule: {type(schedule).__name__}; build one with "
            "autotune.traffic (Schedule with mode 'open' or 'closed')"
        )
    if conc is not None and conc < 1:
        raise LoadgenError(f"schedule concurrency is {conc}; it must be >= 1 (or None)")
    if mode == "closed" and conc is None:
        raise LoadgenError("closed-loop schedule has concurrency=None; set the number of streams")
    for spec in requests:
        if spec.max_tokens < 1:
            raise LoadgenError(
                f"request {spec.index}: max_tokens is {spec.max_tokens}; it must be >= 1"
            )
        if mode == "open" and (
            spec.send_at_s is None or not math.isfinite(spec.send_at_s) or spec.send_at_s < 0
        ):
            raise LoadgenError(
                f"request {spec.index}: open-loop send_at_s is {spec.send_at_s}; "
                "it must be a finite offset >= 0 s"
            )
    return mode, conc, requests


async def _sample_metrics(
    base_url: str,
    interval_s: float,
    out: list[tuple[float, str]],
    stop: asyncio.Event,
    first: asyncio.Event,
) -> None:
    """Fetch /metrics every ``interval_s`` until ``stop`` is set (one last fetch then).

    Only the text is kept: parsing a vLLM /metrics page takes milliseconds, which would
    stall every stream's timestamps if done on this loop mid-run. :func:`run_schedule`
    parses the samples after the run.
    """
    warned = False
    try:
        while True:
            try:
                out.append(await fetch_metrics_text(base_url))
            except LoadgenError as exc:
                if not warned:
                    logger.warning("no server figures: %s", exc)
                    warned = True
            first.set()
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):  # not wait_for: see _http1.Pool
                    await stop.wait()
    finally:
        first.set()


def _parse_samples(samples: list[tuple[float, str]]) -> tuple[ServerSnapshot, ...]:
    snaps = []
    for taken_at, text in samples:
        try:
            snaps.append(parse_metrics(text, taken_at=taken_at))
        except LoadgenError as exc:
            logger.warning("a /metrics sample was left out: %s", exc)
    return tuple(snaps)


def _target(base_url: str, request_timeout_s: float, stall_timeout_s: float
            ) -> tuple[str, Target]:
    """The server's base URL and connection target; a LoadgenError for unusable ones."""
    if not (request_timeout_s > 0 and stall_timeout_s > 0):
        raise LoadgenError(
            f"timeouts must be > 0 s (request_timeout_s={request_timeout_s}, "
            f"stall_timeout_s={stall_timeout_s})"
        )
    base = base_url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise LoadgenError(f"base_url {base_url!r} must start with http:// or https://")
    try:
        return base, Target(base)
    except ValueError as exc:
        raise LoadgenError(f"base_url {base_url!r}: {exc}") from None


async def run_schedule(
    schedule: Schedule,
    *,
    base_url: str,
    model: str,
    api: Api = "completions",
    request_timeout_s: float = 600.0,
    stall_timeout_s: float = 120.0,
    progress: Callable[[int, int], None] | None = None,
    metrics_interval_s: float | None = None,
    control: SegmentControl | None = None,
    refill: Callable[[int], Iterable[RequestSpec]] | None = None,
    stagger: bool = False,
    abort: Abort | None = None,
    interrupt: threading.Event | None = None,
) -> RunResult:
    """Drive ``schedule`` against an OpenAI-compatible server and record every request.

    Closed loop: ``schedule.concurrency`` streams each send the next request as soon as
    their previous one ends. Open loop: request i is sent at ``send_at_s`` after the start
    (at most ``concurrency`` in flight when that is set; late sends are recorded as sent).
    ``metrics_interval_s`` also samples the server's ``/metrics`` during the run
    (``RunResult.snapshots``) so :func:`autotune.measure.measure` can read server figures
    over its steady-state window. ``abort`` (e.g. :func:`failure_abort`) may stop the run
    early: ``RunResult.aborted`` then says why. Raises :class:`LoadgenError` only for an unusable
    schedule or argument; failed requests are records with an error reason.

    Closed loop only: ``control`` (a :class:`SegmentControl`) is told each segment and may
    stop the sends; ``refill(next_index)`` gives more requests when the schedule runs out
    before the control stopped (an empty result ends the run); ``stagger`` shortens each
    stream's first request (:func:`staggered`) so streams do not run in lockstep.

    ``interrupt`` (a :class:`threading.Event`, e.g. set by a signal handler) ends the run
    within 0.1 s of being set: the requests in flight are cancelled, and
    ``RunResult.interrupted_at_s``/``complete_before_s`` say when and up to when the
    records hold every token that arrived.
    """
    mode, conc, specs = _check(schedule)
    if mode != "closed" and (control is not None or refill is not None or stagger):
        raise LoadgenError("control, refill and stagger apply to closed-loop schedules only")
    if api not in _PATHS:
        raise LoadgenError(f"api is {api!r}; use 'completions' or 'chat'")
    base, target = _target(base_url, request_timeout_s, stall_timeout_s)
    n = len(specs)
    _raise_nofile((conc if conc is not None else n) + 64)
    records: dict[int, RequestRecord] = {}
    samples: list[tuple[float, str]] = []
    stop = asyncio.Event()
    sampler: asyncio.Task[None] | None = None
    if metrics_interval_s is not None and metrics_interval_s > 0:
        first = asyncio.Event()
        sampler = asyncio.create_task(
            _sample_metrics(base, metrics_interval_s, samples, stop, first)
        )
        await first.wait()  # a "before" sample ahead of the first request
    started_at = time.time()
    t0 = time.monotonic()
    pool = Pool(target, t0=t0)
    runner = _Runner(
        pool,
        path=target.path.rstrip("/") + _PATHS[api],
        model=model,
        api=api,
        request_timeout_s=request_timeout_s,
        stall_timeout_s=stall_timeout_s,
        t0=t0,
        total=n,
        progress=progress,
        abort=abort,
    )
    runner.control = control
    if control is not None:
        runner._next_boundary = max(1, control.segment_requests)
    try:
        with _gc_relaxed():
            if mode == "closed":
                streams = conc or 1
                heads = staggered(specs[:streams], streams) if stagger else list(specs[:streams])
                feed = enumerate(_feed(heads, specs[streams:], refill, runner))
                drive = asyncio.ensure_future(_closed(runner, feed, records, streams))
            else:
                drive = asyncio.ensure_future(_open(runner, specs, records, conc))
            stopper = asyncio.ensure_future(runner.stop.wait())
            watcher = (asyncio.ensure_future(runner.watch(interrupt))
                       if interrupt is not None else None)
            ticker = asyncio.ensure_future(runner.tick())
            try:
                await asyncio.wait((drive, stopper), return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopper.cancel()
                ticker.cancel()
                if watcher is not None:
                    watcher.cancel()
                if not drive.done():  # aborted or interrupted: cancel what is in flight
                    drive.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await drive
            if not drive.cancelled():
                drive.result()  # re-raise what the drive raised
    finally:
        wall = time.monotonic() - t0
        pool.close()
        if sampler is not None:
            stop.set()
            await sampler
    return RunResult(
        records=tuple(records[i] for i in sorted(records)),
        started_at=started_at,
        wall_s=wall,
        mode=mode,
        concurrency=conc,
        api=api,
        snapshots=_parse_samples(samples),
        stopped_at_s=runner.stopped_at,
        aborted=runner.aborted,
        interrupted_at_s=runner.interrupted_at,
        complete_before_s=runner.complete_before,
    )


def _feed(first: Sequence[RequestSpec], rest: Sequence[RequestSpec],
          refill: Callable[[int], Iterable[RequestSpec]] | None,
          runner: _Runner) -> Iterator[RequestSpec]:
    """The closed loop's requests in order: the schedule, then refills until stopped."""
    yield from first
    for spec in rest:
        if runner.stopped_at is not None:
            return
        yield spec
    nxt = (rest[-1].index if rest else first[-1].index if first else -1) + 1
    while refill is not None and runner.stopped_at is None:
        got = False
        for spec in refill(nxt):
            if runner.stopped_at is not None:
                return
            got = True
            nxt = spec.index + 1
            yield spec
        if not got:
            return


async def _closed(
    runner: _Runner, specs: Iterator[tuple[int, RequestSpec]], out: dict[int, RequestRecord],
    streams: int,
) -> None:
    async def stream() -> None:
        for i, spec in specs:  # one iterator shared by all streams: each takes the next
            out[i] = await runner.request(spec)

    async with asyncio.TaskGroup() as tg:
        for _ in range(streams):
            tg.create_task(stream())


async def _open(
    runner: _Runner,
    specs: Sequence[RequestSpec],
    out: dict[int, RequestRecord],
    cap: int | None,
) -> None:
    sem = asyncio.Semaphore(cap) if cap is not None else None
    order = sorted(range(len(specs)), key=lambda i: specs[i].send_at_s or 0.0)

    async def one(i: int) -> None:
        try:
            out[i] = await runner.request(specs[i])
        finally:
            if sem is not None:
                sem.release()

    async with asyncio.TaskGroup() as tg:
        for i in order:
            delay = runner.t0 + (specs[i].send_at_s or 0.0) - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            tg.create_task(one(i))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def replay(schedule: Schedule, **kwargs: Any) -> RunResult:
    """Synchronous :func:`run_schedule` on a fresh event loop (uvloop when installed).

    Works from any thread that has no running event loop; inside a coroutine, ``await
    run_schedule(...)`` instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise LoadgenError(
            "replay() was called inside a running event loop; use 'await run_schedule(...)'"
        )
    out: list[RunResult] = []

    async def main() -> None:
        # The result is handed over in a list, not as the task's result: on leaving,
        # asyncio.Runner formats the main task's repr (signal.getsignal), which would
        # repr every record: about 1 s of CPU for a million tokens.
        out.append(await run_schedule(schedule, **kwargs))

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())
    return out[0]
