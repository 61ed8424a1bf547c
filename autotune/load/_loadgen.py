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
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from autotune.errors import LoadgenError
from autotune.load._hooks import hooks_for
from autotune.load._http1 import Pool, Target
from autotune.load._modes import Driver, driver_for
from autotune.load._records import _PATHS, Abort, Api, RequestRecord, RunResult, SegmentControl
from autotune.load._runner import _Runner
from autotune.load._server_metrics import ServerSnapshot, fetch_metrics_text, parse_metrics

if TYPE_CHECKING:
    import threading

    from autotune.load._sessions import SessionSchedule
    from autotune.traffic import RequestSpec, Schedule

logger = logging.getLogger(__name__)


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


def _check_api(api: str, driver: Driver) -> None:
    from autotune.load._sessions import SessionLoop

    if api not in _PATHS:
        raise LoadgenError(f"api is {api!r}; use 'completions' or 'chat'")
    if api != "completions" and isinstance(driver, SessionLoop):
        raise LoadgenError("a session replay sends token-id prompts: use api 'completions'")


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
    schedule: Schedule | SessionSchedule,
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

    A :class:`autotune.load.SessionSchedule` replays sessions turn by turn
    (:mod:`autotune.load._sessions`; completions API only).

    The mode is a driver (:mod:`autotune.load._modes`: :class:`OpenLoop`,
    :class:`ClosedLoop`, :class:`SessionLoop`); progress, segments, the abort rule and the
    interrupt are hooks that watch the run (:mod:`autotune.load._hooks`).
    """
    driver = driver_for(schedule, control=control, refill=refill, stagger=stagger)
    _check_api(api, driver)
    base, target = _target(base_url, request_timeout_s, stall_timeout_s)
    _raise_nofile(driver.connections() + 64)
    hooks = hooks_for(progress=progress, total=len(driver.requests), control=control,
                      abort=abort, interrupt=interrupt)
    records: dict[int, RequestRecord] = {}
    async with _sampling(base, metrics_interval_s) as samples:
        started_at = time.time()
        t0 = time.monotonic()
        pool = Pool(target, t0=t0)
        runner = _Runner(pool, path=target.path.rstrip("/") + _PATHS[api], model=model,
                         api=api, request_timeout_s=request_timeout_s,
                         stall_timeout_s=stall_timeout_s, t0=t0, hooks=hooks)
        try:
            with _gc_relaxed():
                await _drive(driver, runner, records)
        finally:
            wall = time.monotonic() - t0
            pool.close()
    return RunResult(
        records=tuple(records[i] for i in sorted(records)),
        started_at=started_at,
        wall_s=wall,
        mode=driver.mode,
        concurrency=driver.concurrency,
        api=api,
        snapshots=_parse_samples(samples),
        stopped_at_s=runner.stopped_at,
        aborted=runner.aborted,
        interrupted_at_s=runner.interrupted_at,
        complete_before_s=runner.complete_before,
    )


async def _drive(driver: Driver, runner: _Runner, out: dict[int, RequestRecord]) -> None:
    """Run ``driver`` with the hooks' tasks beside it until it is done or a hook ends the
    run (``runner.stop``): then what is in flight is cancelled. Re-raises what it raised."""
    drive = asyncio.ensure_future(driver.drive(runner, out))
    stopper = asyncio.ensure_future(runner.stop.wait())
    watchers = [asyncio.ensure_future(hook.watch(runner)) for hook in runner.hooks]
    try:
        await asyncio.wait((drive, stopper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        for watcher in watchers:
            watcher.cancel()
        if not drive.done():  # aborted or interrupted: cancel what is in flight
            drive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drive
    if not drive.cancelled():
        drive.result()  # re-raise what the drive raised


@contextlib.asynccontextmanager
async def _sampling(base_url: str, interval_s: float | None
                    ) -> AsyncIterator[list[tuple[float, str]]]:
    """The /metrics texts taken every ``interval_s`` while the block runs (none when
    ``interval_s`` is unset): one before it starts, one after it ends."""
    samples: list[tuple[float, str]] = []
    if interval_s is None or interval_s <= 0:
        yield samples
        return
    stop = asyncio.Event()
    first = asyncio.Event()
    sampler = asyncio.create_task(_sample_metrics(base_url, interval_s, samples, stop, first))
    await first.wait()  # a "before" sample ahead of the first request
    try:
        yield samples
    finally:
        stop.set()
        await sampler


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def replay(schedule: Schedule | SessionSchedule, **kwargs: Any) -> RunResult:
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
