"""What watches a run besides its driver: the progress callback, a closed loop's segment
control, the abort rule (and its clock tick) and the interrupt. Each is a :class:`Hook`:
told of every finished request, and given a task of its own while the run lasts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    from autotune.load._records import Abort, RequestRecord, SegmentControl
    from autotune.load._runner import _Runner


class Hook:
    """Watches one run (:class:`autotune.load._runner._Runner`) and may end it.

    ``finished(run, rec)`` is called on the event loop after each request (keep it quick:
    every stream waits for it), after ``run.done`` and ``run.failed`` count ``rec``.
    ``watch(run)`` runs as a task of its own from the first send until the run ends, when
    it is cancelled. A hook stops the sends with ``run.stopped_at`` (requests in flight
    finish) or ends the run with :meth:`_Runner.abort_with` or ``run.stop`` (what is in
    flight is cancelled). Both do nothing by default.
    """

    def finished(self, run: _Runner, rec: RequestRecord) -> None:
        """After each finished request."""

    async def watch(self, run: _Runner) -> None:
        """For the run's duration."""


class Progress(Hook):
    """``callback(done, total)`` after each finished request."""

    def __init__(self, callback: Callable[[int, int], None], total: int) -> None:
        self.callback = callback
        self.total = total

    def finished(self, run: _Runner, rec: RequestRecord) -> None:
        self.callback(run.done, self.total)


class Segments(Hook):
    """A closed loop cut into segments of ``control.segment_requests`` finished requests:
    the control is told each one (time, tokens so far, failures) and may stop the sends."""

    def __init__(self, control: SegmentControl) -> None:
        self.control = control
        self.next_boundary = max(1, control.segment_requests)

    def finished(self, run: _Runner, rec: RequestRecord) -> None:
        if run.stopped_at is not None or run.done < self.next_boundary:
            return
        self.next_boundary = run.done + max(1, self.control.segment_requests)
        if run.done > 0:
            now = run.now()
            if self.control.on_segment(now, run.tokens(), run.failed):
                run.stopped_at = now


class AbortRule(Hook):
    """The run's :data:`autotune.load.Abort` hook: asked after each finished request, and
    once every ``every_s`` through its ``tick(now)`` when it has one (a time cap holds while
    no request finishes). Its first line ends the run."""

    def __init__(self, abort: Abort, every_s: float = 1.0) -> None:
        self.abort = abort
        self.every_s = every_s

    def finished(self, run: _Runner, rec: RequestRecord) -> None:
        if run.aborted is None:
            why = self.abort(rec, run.done, run.failed)
            if why:
                run.abort_with(why)

    async def watch(self, run: _Runner) -> None:
        tick = getattr(self.abort, "tick", None)
        while tick is not None and not run.stop.is_set():
            await asyncio.sleep(self.every_s)
            if run.aborted is None:
                why = tick(run.now())
                if why:
                    run.abort_with(why)


class Interrupt(Hook):
    """Ends the run within ``every_s`` of ``event`` being set: no more sends, the requests
    in flight cancelled (waiting for them could take a whole request's duration); the run
    says when, and up to when its records hold every token that arrived."""

    def __init__(self, event: threading.Event, every_s: float = 0.1) -> None:
        self.event = event
        self.every_s = every_s

    async def watch(self, run: _Runner) -> None:
        while not run.stop.is_set():
            if self.event.is_set():
                now = run.now()
                run.interrupted_at = now
                run.complete_before = min(run.live.values(), default=now)
                if run.stopped_at is None:
                    run.stopped_at = now
                run.stop.set()
                return
            await asyncio.sleep(self.every_s)


def hooks_for(*, progress: Callable[[int, int], None] | None, total: int,
              control: SegmentControl | None, abort: Abort | None,
              interrupt: threading.Event | None) -> list[Hook]:
    """The hooks of a run, in the order they hear of a finished request."""
    hooks: list[Hook] = []
    if progress is not None:
        hooks.append(Progress(progress, total))
    if control is not None:
        hooks.append(Segments(control))
    if abort is not None:
        hooks.append(AbortRule(abort))
    if interrupt is not None:
        hooks.append(Interrupt(interrupt))
    return hooks
