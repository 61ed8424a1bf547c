"""Progress of a study for people: a live display on a terminal, plain lines elsewhere.

The display is a subscriber fed plain event objects (``StudyEvent``s of the study loop and
``on_trial_phase`` calls); it keeps what it shows in a :class:`ProgressState`, so the state
is testable without a terminal. On a terminal (and without ``--quiet``) it draws a rich
``Live`` panel: trials done of total with a bar, each running trial's phase (starting,
warming up, measuring, re-check, quality) with its elapsed time, the best so far with its
interval, and the time left; finished trials scroll above it as lines. Elsewhere (CI, a log
file, ``--quiet``) it prints the same facts as plain lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autotune.events import StudyCallback, StudyContext, StudyEvent, TrialRecord
from autotune.measure import fmt_interval, fmt_ratio, fmt_value

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.live import Live
    from rich.progress import Progress, TaskID

    from autotune.events import ParamValue
    from autotune.results import TuneResult

__all__ = ["PHASE_LABELS", "ProgressDisplay", "ProgressState", "fmt_duration", "make_display",
           "stores_line"]

#: phase (:data:`autotune.events.PHASES`) -> what the display calls it
PHASE_LABELS = {"starting": "starting", "warming_up": "warming up", "measuring": "measuring",
                "capacity": "capacity search", "recheck": "re-check", "quality": "quality probe"}


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "not known yet"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@dataclass
class _Running:
    phase: str
    since: float  # monotonic time the phase began
    started: float
    params: dict[str, ParamValue]
    recheck: bool = False


@dataclass
class ProgressState:
    """What the display shows, updated from events (``clock`` injectable for tests)."""

    clock: Callable[[], float] = time.monotonic
    study_name: str = ""
    done: int = 0
    total: int = 0
    best_value: float | None = None
    best_number: int | None = None
    # the best's interval; its high end None: a capacity no level bounded (a lower bound)
    best_ci: tuple[float, float | None] | None = None
    baseline_value: float | None = None
    eta_s: float | None = None
    elapsed_s: float = 0.0
    at: float | None = None  # clock() when elapsed_s and eta_s were taken (the last event)
    started_running: int | None = None  # the study's own count at a trial_started event
    in_recheck: bool = False
    running: dict[int, _Running] = field(default_factory=dict)

    def apply(self, e: StudyEvent) -> None:
        """Update from a ``StudyEvent``."""
        self.study_name = e.study_name or self.study_name
        self.done, self.total = e.done, e.total
        self.best_value, self.best_number = e.best_value, e.best_number
        lo, hi = getattr(e, "best_ci_low", None), getattr(e, "best_ci_high", None)
        self.best_ci = (lo, hi) if lo is not None else None
        self.baseline_value, self.eta_s, self.elapsed_s = e.baseline_value, e.eta_s, e.elapsed_s
        now = self.clock()
        self.at = now
        self.started_running = e.running if e.kind == "trial_started" else None
        if e.kind == "recheck_started":
            self.in_recheck = True
        elif e.kind == "trial_started" and e.trial_number is not None:
            self.running[e.trial_number] = _Running("starting", now, now, dict(e.trial_params),
                                                    recheck=self.in_recheck)
        elif e.kind == "trial_finished" and e.trial_number is not None:
            self.running.pop(e.trial_number, None)

    def phase(self, number: int, phase: str, elapsed_s: float = 0.0) -> None:
        """A running trial entered ``phase`` (``elapsed_s`` ago)."""
        now = self.clock()
        run = self.running.setdefault(number, _Running(phase, now, now, {}))
        run.phase, run.since = phase, now - elapsed_s

    def phase_label(self, number: int) -> str:
        run = self.running[number]
        label = PHASE_LABELS.get(run.phase, run.phase)
        return f"re-check: {label}" if run.recheck and run.phase != "recheck" else label

    def best_text(self, label: str) -> str:
        if self.best_value is None:
            return "best -"
        from rich.markup import escape  # "[a, b]" would read as a markup tag

        if self.best_ci is not None and self.best_ci[1] is None:  # no failing level
            return (f"best at least {fmt_value(self.best_value)} {label} (trial "
                    f"{self.best_number}: no load level failed)")
        ci = (f" {escape(fmt_interval(self.best_ci[0], self.best_ci[1]))}" if self.best_ci
              else "")
        ratio = (f", {fmt_ratio(self.best_value / self.baseline_value)} defaults"
                 if self.baseline_value else "")
        return f"best {fmt_value(self.best_value)}{ci} {label} (trial {self.best_number}{ratio})"

    def since_event(self) -> float:
        return 0.0 if self.at is None else max(0.0, self.clock() - self.at)

    def elapsed_now(self) -> float:
        """The study's elapsed time now, not at the last event (a trial runs for minutes)."""
        return self.elapsed_s + self.since_event()

    def eta_now(self) -> float | None:
        return None if self.eta_s is None else max(0.0, self.eta_s - self.since_event())

    def n_running(self) -> int:
        # a finished trial leaves ``running`` at its own event, which the study sends after
        # it has launched the next one: at that start, the start event's own count is right
        n = len(self.running)
        return n if self.started_running is None else min(n, self.started_running)

    def head(self, label: str) -> str:
        return (f"[{self.done}/{self.total} done, {self.n_running()} running | "
                f"{self.best_text(label)} | elapsed {fmt_duration(self.elapsed_now())}, "
                f"{self.left_text()}]")

    def left_text(self) -> str:
        """"left ~3m00s", or before the first trial ends "time left not known yet"."""
        eta = self.eta_now()
        return f"left ~{fmt_duration(eta)}" if eta is not None else "time left not known yet"


def stores_line(storage: str, tracking_uri: str) -> str:
    """Where a study's stores are: 'stores: Optuna sqlite:////abs/autotune.db, MLflow
    sqlite:////abs/mlflow.db' (absolute paths, no password)."""
    from autotune.config import store_where

    mlflow = f", MLflow {store_where(tracking_uri)}" if tracking_uri else ""
    return f"stores: Optuna {store_where(storage)}{mlflow}"


def _params(params: Mapping[str, ParamValue]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "vLLM defaults"


class ProgressDisplay(StudyCallback):
    """Subscriber to a study's events (:class:`autotune.events.StudyCallback`; also
    callable with a bare ``StudyEvent``). ``live``: draw a rich Live panel (a terminal),
    else print plain lines; ``quiet``: plain lines for finished trials and the study only."""

    def __init__(self, metric_label: str, *, console: Console | None = None,
                 live: bool | None = None, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True, highlight=False)
        self.label = metric_label
        self.quiet = quiet
        self.live_mode = (self.console.is_terminal if live is None else live) and not quiet
        self.state = ProgressState(clock=clock)
        self._live: Live | None = None
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self.stores = ""  # where the study's stores are (stores_line), once it started

    # -- the study's hooks -------------------------------------------------------------------
    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        self.stores = stores_line(context.settings.storage, context.tracking_uri)
        self.console.print(self.stores, highlight=False, soft_wrap=True, markup=False)
        self(event)

    def on_note(self, event: StudyEvent) -> None:
        self(event)

    def on_trial_start(self, event: StudyEvent) -> None:
        self(event)

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        if not record.rejected:  # a sample the space's rules forbid never ran: no line
            self(event)

    def on_study_end(self, event: StudyEvent, result: TuneResult | None) -> None:
        if result is not None:
            self(event)
        self.close()
        if self.stores:  # where to --resume, browse or report from, however it ended
            self.console.print(self.stores, highlight=False, soft_wrap=True, markup=False)

    # -- events ------------------------------------------------------------------------------
    def __call__(self, e: StudyEvent) -> None:
        self.state.apply(e)
        line = self._line(e)
        if line is not None:  # a log gets whole lines, however long
            self.console.print(line, highlight=False, soft_wrap=not self.live_mode)
        if e.kind == "study_started" and self.live_mode:
            self._start_live()
        elif e.kind == "study_finished":
            self.close()
        self.refresh()

    def on_trial_phase(self, number: int, phase: str, elapsed_s: float = 0.0,
                       detail: str = "") -> None:
        self.state.phase(number, phase, elapsed_s)
        if not self.live_mode and not self.quiet and phase != "starting":
            self.console.print(f"{self.state.head(self.label)} trial {number}: "
                               f"{self.state.phase_label(number)}"
                               + (f" ({detail})" if detail else ""), highlight=False,
                               soft_wrap=True)
        self.refresh()

    def _line(self, e: StudyEvent) -> str | None:
        # the live panel shows done/best/time left: its lines need no such prefix
        head = f"[{e.done}/{e.total}]" if self.live_mode else self.state.head(self.label)
        if e.kind == "study_started":
            return f"study [bold]{e.study_name}[/]: {e.message}"
        if e.kind in ("note", "recheck_started"):
            return None if self.quiet else f"{head} {e.message}"
        if e.kind == "trial_started":
            return None if (self.quiet or self.live_mode) else \
                f"{head} trial {e.trial_number} started: {_params(e.trial_params)}"
        if e.kind == "trial_finished":
            return f"{head} trial {e.trial_number}: {self._outcome(e)}"
        if e.kind == "study_finished":
            return f"study finished in {fmt_duration(e.elapsed_s)}"
        return None

    def _outcome(self, e: StudyEvent) -> str:
        from rich.markup import escape  # a message's "[a, b] req/s" is no markup tag

        msg = escape((e.message or "").split("\n", 1)[0][:300])
        if e.trial_value is not None and e.trial_reason is None:
            if getattr(e, "trial_ci_low", None) is not None and \
                    getattr(e, "trial_ci_high", None) is None:  # a capacity with no top
                return (f"[green]at least {fmt_value(e.trial_value)} {self.label}[/] (no load "
                        "level failed: a lower bound)")
            what = f"[green]{fmt_value(e.trial_value)} {self.label}[/]"
            if e.baseline_value:
                what += f" ({fmt_ratio(e.trial_value / e.baseline_value)} defaults)"
            return what
        if e.trial_reason == "pruned":  # a clear loser the pruner cut short: not a failure
            return "[cyan]pruned[/]" + (f": {msg}" if msg else "")
        if e.trial_value is not None:
            return (f"[yellow]{fmt_value(e.trial_value)} {self.label}, infeasible "
                    f"({e.trial_reason})[/]" + (f": {msg}" if msg else ""))
        return f"[red]failed: {e.trial_reason}[/]" + (f": {msg}" if msg else "")

    # -- the live panel ----------------------------------------------------------------------
    def _start_live(self) -> None:
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TextColumn("trials"),
                             console=self.console, auto_refresh=False)
        self._task = self._bar.add_task(self.state.study_name, total=max(1, self.state.total))
        self._live = Live(get_renderable=self.render, console=self.console,
                          refresh_per_second=2, transient=False)
        self._live.start()

    def render(self) -> RenderableType:
        """The live panel: the bar, best so far and time left, a row per running trial."""
        from rich.console import Group
        from rich.table import Table

        s = self.state
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=s.done, total=max(1, s.total))
        table = Table(box=None, show_header=bool(s.running), padding=(0, 2))
        table.add_column("trial", justify="right")
        table.add_column("phase")
        table.add_column("for", justify="right")
        table.add_column("config", overflow="ellipsis", no_wrap=True, max_width=80)
        now = s.clock()
        for n in sorted(s.running):
            r = s.running[n]
            table.add_row(str(n), s.phase_label(n), fmt_duration(now - r.since),
                          _params(r.params))
        info = (f"{s.best_text(self.label)}   elapsed {fmt_duration(s.elapsed_now())}, "
                f"{s.left_text()}")
        parts = [self._bar, info] if self._bar is not None else [info]
        return Group(*parts, table)

    def refresh(self) -> None:
        if self._live is not None:
            self._live.refresh()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def make_display(metric_label: str, *, quiet: bool = False,
                 console: Console | None = None) -> ProgressDisplay:
    """The live panel on a terminal, plain lines otherwise (or with ``quiet``)."""
    return ProgressDisplay(metric_label, console=console, quiet=quiet)
