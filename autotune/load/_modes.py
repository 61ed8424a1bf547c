"""The modes of the load generator: how a run sends its schedule's requests.

A :class:`Driver` owns the sends and nothing else; the records, the counts and the hooks
that watch a run (:mod:`autotune.load._hooks`) are the same in every mode.
:class:`OpenLoop` sends each request at its scheduled time; :class:`ClosedLoop` keeps N
streams busy, each sending the next request when its previous one ended, refilled when
the schedule runs out. :func:`driver_for` picks the one a schedule asks for.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from autotune.errors import LoadgenError
from autotune.load._records import RequestRecord, SegmentControl, staggered

if TYPE_CHECKING:
    from autotune.load._runner import _Runner
    from autotune.load._sessions import SessionSchedule
    from autotune.traffic import RequestSpec, Schedule

#: more requests for a closed loop whose schedule ran out: ``refill(next_index)``
Refill = Callable[[int], Iterable["RequestSpec"]]


class Driver(Protocol):
    """How a run sends its requests (one mode of the load generator).

    ``drive(run, out)`` sends the schedule's requests with ``run.request(spec)`` and puts
    each record in ``out`` under its position in the send order; it returns when every
    request it sent has finished. It sends nothing more once ``run.stopped_at`` is set
    (when the mode can stop early) and is cancelled when ``run.stop`` is set. ``mode`` and
    ``concurrency`` are what :class:`autotune.load.RunResult` records; ``requests`` the
    schedule's (what the progress callback counts to); ``connections()`` the most
    requests in flight at once (sockets to allow for).
    """

    @property
    def mode(self) -> Literal["open", "closed"]: ...

    @property
    def concurrency(self) -> int | None: ...

    @property
    def requests(self) -> Sequence[RequestSpec]: ...

    def connections(self) -> int: ...

    async def drive(self, run: _Runner, out: dict[int, RequestRecord]) -> None: ...


@dataclass(frozen=True)
class OpenLoop:
    """Request i is sent at its ``send_at_s`` after the run's start, whatever the server
    does (a late send is recorded as sent); at most ``cap`` in flight when set."""

    requests: Sequence[RequestSpec]
    cap: int | None = None

    @property
    def mode(self) -> Literal["open", "closed"]:
        return "open"

    @property
    def concurrency(self) -> int | None:
        return self.cap

    def connections(self) -> int:
        return self.cap if self.cap is not None else len(self.requests)

    async def drive(self, run: _Runner, out: dict[int, RequestRecord]) -> None:
        specs = self.requests
        sem = asyncio.Semaphore(self.cap) if self.cap is not None else None
        order = sorted(range(len(specs)), key=lambda i: specs[i].send_at_s or 0.0)

        async def one(i: int) -> None:
            try:
                out[i] = await run.request(specs[i])
            finally:
                if sem is not None:
                    sem.release()

        async with asyncio.TaskGroup() as tg:
            for i in order:
                delay = run.t0 + (specs[i].send_at_s or 0.0) - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem is not None:
                    await sem.acquire()
                tg.create_task(one(i))


@dataclass(frozen=True)
class ClosedLoop:
    """``streams`` streams each send the next request as soon as their previous one ends;
    ``refill(next_index)`` gives more requests when the schedule runs out before the sends
    stopped (an empty result ends the run); ``stagger`` shortens each stream's first
    request (:func:`autotune.load.staggered`) so streams do not run in lockstep."""

    requests: Sequence[RequestSpec]
    streams: int
    refill: Refill | None = None
    stagger: bool = False

    @property
    def mode(self) -> Literal["open", "closed"]:
        return "closed"

    @property
    def concurrency(self) -> int | None:
        return self.streams

    def connections(self) -> int:
        return self.streams

    async def drive(self, run: _Runner, out: dict[int, RequestRecord]) -> None:
        n = self.streams
        first = self.requests[:n]
        heads = staggered(first, n) if self.stagger else list(first)
        specs = enumerate(self._feed(heads, self.requests[n:], run))

        async def stream() -> None:
            for i, spec in specs:  # one iterator shared by all streams: each takes the next
                out[i] = await run.request(spec)

        async with asyncio.TaskGroup() as tg:
            for _ in range(n):
                tg.create_task(stream())

    def _feed(self, first: Sequence[RequestSpec], rest: Sequence[RequestSpec],
              run: _Runner) -> Iterator[RequestSpec]:
        """The requests in order: the schedule, then refills until the sends stop."""
        yield from first
        for spec in rest:
            if run.stopped_at is not None:
                return
            yield spec
        nxt = (rest[-1].index if rest else first[-1].index if first else -1) + 1
        while self.refill is not None and run.stopped_at is None:
            got = False
            for spec in self.refill(nxt):
                if run.stopped_at is not None:
                    return
                got = True
                nxt = spec.index + 1
                yield spec
            if not got:
                return


def driver_for(schedule: Schedule | SessionSchedule, *, control: SegmentControl | None = None,
               refill: Refill | None = None, stagger: bool = False) -> Driver:
    """The driver of ``schedule``'s mode; a :class:`LoadgenError` for an unusable schedule,
    or for a closed loop's options (``control``, ``refill``, ``stagger``) on an open one.
    A :class:`autotune.load.SessionSchedule` gets the session replay's driver."""
    from autotune.load._sessions import SessionLoop, SessionSchedule

    if isinstance(schedule, SessionSchedule):
        if control is not None or refill is not None or stagger:
            raise LoadgenError("control, refill and stagger do not apply to a session replay")
        if not schedule.sessions:
            raise LoadgenError("the session schedule has no session; draw at least one")
        return SessionLoop(schedule)
    mode, conc, specs = _check(schedule)
    if mode == "closed":
        return ClosedLoop(specs, streams=conc or 1, refill=refill, stagger=stagger)
    if control is not None or refill is not None or stagger:
        raise LoadgenError("control, refill and stagger apply to closed-loop schedules only")
    return OpenLoop(specs, cap=conc)


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
