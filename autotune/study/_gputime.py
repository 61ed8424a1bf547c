"""The GPU-time account of a study: how long each trial held its GPUs, by phase.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypedDict

from autotune.store import (
    A,
)
from autotune.trial import TrialOutcome

if TYPE_CHECKING:

    import optuna


logger = logging.getLogger(__name__)


def _slot_label(outcome: TrialOutcome) -> str:
    if outcome.gpus:  # "gpu0", "gpu2-3" (a trial on two GPUs); names MLflow accepts as keys
        return "gpu" + "-".join(str(g) for g in outcome.gpus)
    return f"cpu:{outcome.hostname}" if outcome.hostname else "cpu"


Phase = Literal["start_s", "compile_s", "warmup_s", "measure_s", "other_s"]
_PHASES: tuple[Phase, ...] = ("start_s", "compile_s", "warmup_s", "measure_s", "other_s")


class TimeRecord(TypedDict):
    """``trial_time()``: the ``autotune.time`` attribute of a trial (seconds)."""

    start_s: float
    compile_s: float  # of start_s
    warmup_s: float
    measure_s: float
    other_s: float
    slot: str  # "gpu0", "gpu2-3", "cpu:<host>"
    start_phases: dict[str, float]  # of start_s, by phase (autotune.trial.start_phases)


def trial_time(outcome: TrialOutcome) -> TimeRecord:
    """Where a trial's wall time went (seconds) and on which slot (``autotune.time``)."""
    start = float(outcome.start_s or 0.0)
    other = max(0.0, outcome.wall_s - start - outcome.warmup_s - outcome.measure_s)
    return {"start_s": round(start, 2), "compile_s": round(float(outcome.compile_s or 0.0), 2),
            "warmup_s": round(outcome.warmup_s, 2),
            "measure_s": round(outcome.measure_s, 2), "other_s": round(other, 2),
            "slot": _slot_label(outcome), "start_phases": dict(outcome.start_phases)}


class GpuTime:
    """Seconds per GPU (or CPU slot) spent starting servers, warming up, measuring, in the
    rest of a trial (stop, quality probe) and idle (the study's span less all of those).
    ``compile_s`` is the part of ``start_s`` that vLLM logged compiling (not added again).
    GPU-seconds: a trial on four GPUs adds its times to each of the four."""

    def __init__(self, slots: int, gpus: Sequence[int] = ()) -> None:
        self.slots = slots
        self.per: dict[str, dict[str, float]] = {}
        for g in gpus:  # every GPU of the executor, so one never used shows as idle
            self._slot(f"gpu{g}")

    def add(self, outcome: TrialOutcome) -> None:
        t = trial_time(outcome)
        for label in ([f"gpu{g}" for g in outcome.gpus] if outcome.gpus else [str(t["slot"])]):
            acc = self._slot(label)
            for k in _PHASES:
                acc[k] = acc.get(k, 0.0) + float(t[k])

    def add_kernels(self, seconds: float, gpus: Sequence[int]) -> None:
        """Kernel tuning before trial 0 (``kernels_s``) on each GPU it timed on."""
        for g in gpus:
            acc = self._slot(f"gpu{g}")
            acc["kernels_s"] = acc.get("kernels_s", 0.0) + seconds

    def _slot(self, label: str) -> dict[str, float]:
        return self.per.setdefault(label, {"start_s": 0.0, "warmup_s": 0.0, "measure_s": 0.0,
                                           "idle_s": 0.0, "other_s": 0.0, "compile_s": 0.0})

    def close(self, span_s: float) -> None:
        """Idle = the loop's span (times the slots a CPU label stands for) less busy time."""
        for label, acc in self.per.items():
            n = 1 if label.startswith("gpu") else self.slots
            busy = sum(v for k, v in acc.items() if k not in ("idle_s", "compile_s"))
            acc["idle_s"] = max(0.0, n * span_s - busy)
            for k in acc:
                acc[k] = round(acc[k], 1)

    def save(self, study: optuna.Study) -> None:
        """Add this session's account to what earlier sessions of the study recorded."""
        total = {k: dict(v) for k, v in (study.user_attrs.get(A.GPU_TIME) or {}).items()}
        for label, acc in self.per.items():
            cur = total.setdefault(label, {})
            for k, v in acc.items():
                cur[k] = round(float(cur.get(k, 0.0)) + v, 1)
        study.set_user_attr(A.GPU_TIME, total)
