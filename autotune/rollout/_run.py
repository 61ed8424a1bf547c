"""The rollout: move a router's traffic to new servers step by step, judged on the servers'
own ``/metrics``; promote, or roll back at once.

Each step changes the router's membership (new servers in first, then old ones out), then
is held: every ``interval_s`` all servers of the step are scraped at the same moment and the
new side is judged against the old one over the window since the step began
(:func:`~autotune.rollout._compare.judge`). A regression, an error burst or a new server
that stops answering ends the rollout with a rollback; a step that stays undecided past
``step_timeout_s`` is rolled back too (promotion needs proof). Removed servers are drained:
out of the router first, stopped only once they run and queue no request.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NotRequired, TypedDict

from autotune.load import _http
from autotune.rollout._compare import (
    Judgement,
    ServerScrape,
    SideFigures,
    judge,
    parse_scrape,
    side_figures,
)
from autotune.rollout._log import RolloutLog
from autotune.rollout._plan import Step, plan_steps
from autotune.rollout._router import RouterClient
from autotune.rollout._settings import RolloutSettings

__all__ = ["ManagedServer", "RolloutRecord", "RolloutResult", "SideRecord", "StepRecord",
           "run_rollout"]

logger = logging.getLogger(__name__)
_DEAD_AFTER = 2  # consecutive failed scrapes of a new server: it is dead


@dataclass
class ManagedServer:
    """A server of the rollout: its URL and, when autotune started it, how to stop it and
    whether its process still runs."""

    url: str
    stop: Callable[[], object] | None = None
    poll: Callable[[], int | None] | None = None

    def exited(self) -> bool:
        return self.poll is not None and self.poll() is not None


class SideRecord(TypedDict):
    """One side's figures over a comparison window (``rollout.jsonl``, ``summary.json``)."""

    finished: int
    errors: int
    output_tokens_per_s: float
    running: float
    waiting: float


class StepRecord(TypedDict):
    """A step of the rollout: a comparison (``decision``, both sides, every metric's
    verdict) or the final switch (``final``, ``held_s``)."""

    step: int
    label: str
    elapsed_s: NotRequired[float]
    decision: NotRequired[str]
    why: NotRequired[str]
    new: NotRequired[SideRecord]
    old: NotRequired[SideRecord]
    metrics: NotRequired[list[dict[str, object]]]
    final: NotRequired[bool]
    held_s: NotRequired[float]


class RolloutRecord(TypedDict):
    """:class:`RolloutResult` as ``summary.json`` holds it."""

    outcome: Literal["promoted", "rolled_back"]
    why: str
    steps: list[StepRecord]
    lost_requests: int
    cut_requests: int
    old: list[str]
    new: list[str]


@dataclass
class RolloutResult:
    """How the rollout ended: ``promoted`` or ``rolled_back`` (and why), step by step."""

    outcome: Literal["promoted", "rolled_back"]
    why: str
    steps: list[StepRecord] = field(default_factory=list)
    # held by a new server that died, at its last scrape (running + waiting): a lower bound,
    # requests that reached it after that scrape were cut too; autotune resends none
    lost_requests: int = 0
    cut_requests: int = 0  # still running on a drained server when it had to be stopped
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)

    def as_dict(self) -> RolloutRecord:
        return {"outcome": self.outcome, "why": self.why, "steps": self.steps,
                "lost_requests": self.lost_requests, "cut_requests": self.cut_requests,
                "old": self.old, "new": self.new}


class _Rollback(Exception):  # control flow inside this module only
    def __init__(self, why: str, lost: int = 0) -> None:
        super().__init__(why)
        self.why, self.lost = why, lost


def scrape(url: str, timeout_s: float = 5.0) -> ServerScrape | None:
    """One server's figures now; None when it does not answer."""
    try:
        resp = _http.get(url + "/metrics", timeout_s=timeout_s)
    except _http.HttpError:
        return None
    if resp.status != 200:
        return None
    return parse_scrape(resp.text, taken_at=resp.taken_at)


def _check_ready(router: RouterClient, settings: RolloutSettings,
                 new: Sequence[ManagedServer]) -> list[str]:
    """The old servers; raises before anything changes when the router, an old server or a
    new one is not usable."""
    from autotune.rollout._router import RouterError

    workers = router.list_workers()
    old = list(settings.old) or workers
    for url in old:
        if url not in workers:
            raise RouterError(f"old server {url} is not in the router at {router.base_url} "
                              f"(it routes to {', '.join(workers) or 'nothing'}); fix --old")
    for s in [*(ManagedServer(u) for u in old), *new]:
        try:
            ok = _http.get(s.url + "/health", timeout_s=10.0).status == 200
        except _http.HttpError:
            ok = False
        if not ok or scrape(s.url, 10.0) is None:
            raise RouterError(f"server {s.url} does not answer /health and /metrics; start "
                              "it (or fix the URL) before the rollout")
    return old


class _Run:
    """One rollout's state: who is in the router, who waits to be stopped."""

    def __init__(self, settings: RolloutSettings, router: RouterClient, log: RolloutLog,
                 old: list[str], new: Sequence[ManagedServer]) -> None:
        self.s, self.router, self.log = settings, router, log
        self.old = old
        self.new = {m.url: m for m in new}
        self.in_router: set[str] = set(old)
        self.last: dict[str, ServerScrape] = {}
        self.fails: dict[str, int] = {}
        self.result = RolloutResult("rolled_back", "", old=list(old), new=list(self.new))

    # -- membership ---------------------------------------------------------------------
    def apply(self, step: Step) -> None:
        for url in step.new:
            if url not in self.in_router:
                self.router.add_worker(url)
                self.in_router.add(url)
        for url in self.old:
            if url in self.in_router and url not in step.old:
                self.router.remove_worker(url)
                self.in_router.discard(url)
        self.log.event("step", **step.as_dict(), router=sorted(self.in_router))

    # -- watching -----------------------------------------------------------------------
    def tick(self, urls: Sequence[str]) -> dict[str, ServerScrape]:
        """Scrape ``urls`` now; a new server that died raises :class:`_Rollback`."""
        got: dict[str, ServerScrape] = {}
        for url in urls:
            snap = scrape(url)
            m = self.new.get(url)
            if snap is not None and not (m and m.exited()):
                got[url] = snap
                self.last[url] = snap
                self.fails[url] = 0
                continue
            self.fails[url] = self.fails.get(url, 0) + 1
            if m is not None and (m.exited() or self.fails[url] >= _DEAD_AFTER):
                prev = self.last.get(url)
                held = int(prev.running + prev.waiting) if prev else 0
                raise _Rollback(f"new server {url} died (no answer to /metrics "
                                f"{self.fails[url]} times in a row)", lost=held)
            logger.warning("server %s did not answer /metrics this time", url)
        return got

    def hold(self, step: Step) -> StepRecord:
        """Hold a comparison step until it is decided or the cap passes."""
        urls = [*step.new, *step.old]
        start = self.tick(urls)
        t0 = time.monotonic()
        judgement: Judgement | None = None
        while True:
            time.sleep(self.s.interval_s)
            now = self.tick(urls)
            elapsed = time.monotonic() - t0
            pairs = {u: (start[u], now[u]) for u in urls if u in start and u in now}
            new_side = side_figures([pairs[u] for u in step.new if u in pairs])
            old_side = side_figures([pairs[u] for u in step.old if u in pairs])
            judgement = judge(new_side, old_side, metrics=self.s.metrics,
                              tolerance=self.s.tolerance, error_tolerance=self.s.error_tolerance,
                              min_requests=self.s.min_requests)
            record = _step_record(step, judgement, new_side, old_side, elapsed)
            self.log.event("compare", **record)
            errors = next(v for v in judgement.verdicts if v.metric == "errors")
            burst = new_side.errors - old_side.errors * (new_side.finished
                                                         / max(old_side.finished, 1.0))
            if burst >= self.s.error_burst and (errors.low or 0.0) > 0.0:
                raise _Rollback(f"error burst: {int(new_side.errors)} errors on the new "
                                f"side in {elapsed:.0f} s", lost=0)
            if judgement.decision == "regress":
                self.result.steps.append(record)
                raise _Rollback(f"step {step.number}: {judgement.why}")
            if judgement.decision == "pass" and elapsed >= self.s.min_hold_s:
                self.result.steps.append(record)
                return record
            if elapsed >= self.s.step_timeout_s:
                self.result.steps.append(record)
                raise _Rollback(f"step {step.number} undecided after {elapsed:.0f} s "
                                f"({judgement.why}); promotion needs the interval to decide")

    def hold_final(self, step: Step) -> None:
        """The switch: every old server out; watch the new ones for ``min_hold_s``."""
        for url in step.new:
            self.fails[url] = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.s.min_hold_s:
            time.sleep(min(self.s.interval_s, self.s.min_hold_s))
            self.tick(step.new)
        self.result.steps.append({"step": step.number, "label": step.label, "final": True,
                                  "held_s": round(time.monotonic() - t0, 1)})

    # -- draining -----------------------------------------------------------------------
    def drain(self, url: str) -> None:
        """Wait until ``url`` (out of the router) runs and queues nothing, then stop it."""
        t0 = time.monotonic()
        idle = 0
        snap: ServerScrape | None = None
        while time.monotonic() - t0 < self.s.drain_timeout_s:
            snap = scrape(url)
            if snap is None:
                break  # gone: nothing left to drain
            idle = idle + 1 if snap.running + snap.waiting == 0 else 0
            if idle >= 2:
                break
            time.sleep(0.5)
        cut = int(snap.running + snap.waiting) if snap is not None and idle < 2 else 0
        self.result.cut_requests += cut
        self.log.event("drained", url=url, waited_s=round(time.monotonic() - t0, 1),
                       idle=snap is None or idle >= 2, cut_requests=cut)
        self.stop(url)

    def stop(self, url: str) -> None:
        m = self.new.get(url)
        if m is not None and m.stop is not None:
            m.stop()
            self.log.event("stopped", url=url, by="autotune")
        elif m is None and self.s.stop_drained:
            cmd = self.s.stop_drained.replace("{url}", shlex.quote(url))
            rc = subprocess.run(cmd, shell=True, check=False).returncode
            self.log.event("stopped", url=url, by=cmd, exit=rc)
        else:
            self.log.event("stopped", url=url, by=None,
                           why="drained and out of the router: safe to stop (not started "
                           "by autotune)")

    def rollback(self, why: str, lost: int) -> None:
        self.log.event("rollback", why=why, lost_requests=lost)
        for url in self.old:  # capacity first: the old servers back in
            if url not in self.in_router:
                self.router.add_worker(url)
                self.in_router.add(url)
        for url in self.new:
            if url in self.in_router:
                self.router.remove_worker(url)
                self.in_router.discard(url)
        for url in self.new:
            self.drain(url)
        self.result.outcome, self.result.why = "rolled_back", why
        self.result.lost_requests += lost


def _step_record(step: Step, j: Judgement, new: SideFigures, old: SideFigures, elapsed: float
                 ) -> StepRecord:
    def side(f: SideFigures) -> SideRecord:
        return {"finished": int(f.finished), "errors": int(f.errors),
                "output_tokens_per_s": round(f.output_tokens_per_s, 2),
                "running": f.running, "waiting": f.waiting}

    return {"step": step.number, "label": step.label, "elapsed_s": round(elapsed, 1),
            "decision": j.decision, "why": j.why, "new": side(new), "old": side(old),
            "metrics": [v.as_dict() for v in j.verdicts]}


def run_rollout(*, settings: RolloutSettings, new: Sequence[ManagedServer], log: RolloutLog,
                router: RouterClient | None = None) -> RolloutResult:
    """Roll ``new`` out behind ``settings.router``: promote or roll back (see the module).

    Raises :class:`~autotune.errors.RolloutError` (the router or a server is not usable)
    before anything changes; once the router changed, a failure rolls back first.
    """
    router = router or RouterClient(settings.router)
    old = _check_ready(router, settings, new)
    plan = plan_steps(old=old, new=[m.url for m in new], steps=settings.steps)
    run = _Run(settings, router, log, old, new)
    log.event("plan", router=router.base_url, steps=[s.as_dict() for s in plan],
              settings=settings.model_dump(mode="json"))
    try:
        for step in plan:
            run.apply(step)
            if step.final:
                run.hold_final(step)
            else:
                run.hold(step)
        run.result.outcome, run.result.why = "promoted", "every step passed"
        log.event("promoted", new=list(run.new), old=old)
        for url in old:
            run.drain(url)
    except _Rollback as rb:
        run.rollback(rb.why, rb.lost)
    except BaseException as exc:  # interrupted or failed mid-way: never leave it half done
        run.rollback(f"stopped by {type(exc).__name__}: {exc}", 0)
        raise
    return run.result
