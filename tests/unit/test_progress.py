"""The study's progress display: a rich Live panel on a terminal, plain lines elsewhere.

Fed synthetic StudyEvents (the display is a pure subscriber); the terminal case records a
rich Console with ``force_terminal=True`` into a string, the other a plain file."""

from __future__ import annotations

import io
import re
from typing import Any

from rich.console import Console

from autotune.cli._progress import ProgressDisplay, ProgressState, fmt_duration
from autotune.study import StudyEvent

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _events() -> list[StudyEvent]:
    base: dict[str, Any] = {"study_name": "s1", "total": 4, "running": 0}
    return [
        StudyEvent(kind="study_started", done=0, message="0 finished trial(s) already", **base),
        StudyEvent(kind="trial_started", done=0, trial_number=0, trial_params={}, **base),
        StudyEvent(kind="trial_finished", done=1, trial_number=0, trial_value=1000.0,
                   best_value=1000.0, best_number=0, best_ci_low=950.0, best_ci_high=1040.0,
                   baseline_value=1000.0, eta_s=180.0, elapsed_s=60.0, **base),
        StudyEvent(kind="trial_started", done=1, trial_number=1, best_value=1000.0,
                   best_number=0, trial_params={"max_num_seqs": 64}, **base),
    ]


def _finished_bad(done: int, **kw: Any) -> StudyEvent:
    return StudyEvent(kind="trial_finished", study_name="s1", total=4, running=0, done=done,
                      best_value=1000.0, best_number=0, baseline_value=1000.0, **kw)


def test_state_tracks_trials_phases_and_best() -> None:
    clock = Clock()
    st = ProgressState(clock=clock)
    for e in _events():
        st.apply(e)
    assert (st.done, st.total) == (1, 4) and set(st.running) == {1}
    assert st.phase_label(1) == "starting"
    clock.t += 70
    st.phase(1, "measuring", elapsed_s=5.0)
    assert st.phase_label(1) == "measuring"
    assert clock() - st.running[1].since == 5.0
    assert "best 1,000 tok/s" in st.best_text("tok/s") and "[950" not in st.best_text("x")
    st.apply(StudyEvent(kind="recheck_started", study_name="s1", done=3, total=5, running=0))
    st.apply(StudyEvent(kind="trial_started", study_name="s1", done=3, total=5, running=1,
                        trial_number=4))
    assert st.phase_label(4) == "re-check: starting"
    assert fmt_duration(3725) == "1h02m" and fmt_duration(None) == "not known yet"


def test_terminal_draws_a_live_panel_with_phase_elapsed_best_interval_and_eta() -> None:
    clock = Clock()
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=140, color_system="standard")
    d = ProgressDisplay("tok/s", console=console, clock=clock)
    assert d.live_mode
    events = _events()
    for e in events[:3]:
        d(e)
    d(events[3])
    clock.t += 42
    d.on_trial_phase(1, "warming_up", 12.0)
    text = " ".join(ANSI.sub("", buf.getvalue()).split())
    assert "\x1b[" in buf.getvalue()  # a terminal: colours and cursor moves
    assert "1/4" in text and "trials" in text  # the bar: done of total
    assert "warming up 0m12s" in text  # the running trial, its phase, elapsed
    assert "max_num_seqs=64" in text
    assert "[950, 1,040]" in text  # best so far with its interval
    assert "left ~3m00s" in text
    assert "trial 0: 1,000 tok/s" in text  # a finished trial scrolls above as a line
    assert "trial 1 started" not in text  # the panel shows starts; no line per start
    d(_finished_bad(2, trial_number=1, trial_value=10.0, trial_reason="errors",
                    message="error rate 80.0% > 5.0% (stalled 78 %)"))
    d(StudyEvent(kind="study_finished", study_name="s1", done=4, total=4, running=0,
                 elapsed_s=300.0))
    text = " ".join(ANSI.sub("", buf.getvalue()).split())
    assert "infeasible (errors): error rate 80.0% > 5.0% (stalled 78 %)" in text
    assert "study finished in 5m00s" in text
    assert d._live is None  # stopped


def test_not_a_terminal_prints_plain_lines_with_reasons() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=60)  # a narrow log: no wrapping
    d = ProgressDisplay("tok/s", console=console, clock=Clock())
    assert not d.live_mode
    for e in _events():
        d(e)
    d.on_trial_phase(1, "measuring", 0.0)
    d(_finished_bad(2, trial_number=1, trial_reason="invalid_config",
                    message="vLLM rejected the flags\n--- server log tail ---\n..."))
    d.close()
    out = buf.getvalue()
    assert "\x1b[" not in out  # no escape codes in a log
    lines = out.splitlines()
    assert any("trial 1 started: max_num_seqs=64" in ln for ln in lines)
    assert any("trial 1: measuring" in ln for ln in lines)
    assert any("failed: invalid_config: vLLM rejected the flags" in ln for ln in lines)
    assert all("server log tail" not in ln for ln in lines)  # one line per trial
    assert any("[1/4 done" in ln and "best 1,000 [950, 1,040] tok/s" in ln for ln in lines)


def test_quiet_prints_only_finished_trials() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=200)
    d = ProgressDisplay("tok/s", console=console, quiet=True, clock=Clock())
    assert not d.live_mode  # --quiet: no live panel even on a terminal
    for e in _events():
        d(e)
    d.on_trial_phase(1, "measuring", 0.0)
    out = ANSI.sub("", buf.getvalue())
    assert "started" not in out and "measuring" not in out
    assert "trial 0: 1,000 tok/s" in out


def test_plain_lines_tick_elapsed_and_left_between_events() -> None:
    """A trial runs for minutes between the study's events: a phase line says the study's
    elapsed time and time left as of now, not as of the last event (the H200 log read
    "elapsed 0m37s" for four minutes), and never more trials running than are not done
    (the study launches the next trial before it reports the finished one)."""
    clock = Clock()
    buf = io.StringIO()
    d = ProgressDisplay("tok/s", console=Console(file=buf, force_terminal=False, width=80),
                        clock=clock)
    base: dict[str, Any] = {"study_name": "s1", "total": 2, "running": 1}
    d(StudyEvent(kind="trial_started", done=0, trial_number=0, trial_params={},
                 elapsed_s=37.0, eta_s=400.0, **base))
    clock.t += 100
    d.on_trial_phase(0, "measuring", 0.0)
    assert "elapsed 2m17s, left ~5m00s" in buf.getvalue().splitlines()[-1]
    clock.t += 500  # past the estimate: "left" stops at zero
    d.on_trial_phase(0, "measuring", 0.0)
    assert "left ~0m00s" in buf.getvalue().splitlines()[-1]
    # trial 1 starts before trial 0's end is reported (the study's own count says 1)
    d(StudyEvent(kind="trial_started", done=1, trial_number=1, trial_params={},
                 elapsed_s=640.0, eta_s=240.0, **{**base, "total": 3}))
    assert "[1/3 done, 1 running" in buf.getvalue().splitlines()[-1]
    d(StudyEvent(kind="trial_finished", done=1, trial_number=0, trial_value=1.0,
                 elapsed_s=640.0, **{**base, "total": 3, "running": 0}))  # made before
    assert "[1/3 done, 1 running" in buf.getvalue().splitlines()[-1]
    d.on_trial_phase(1, "measuring", 0.0)
    assert "[1/3 done, 1 running" in buf.getvalue().splitlines()[-1]
