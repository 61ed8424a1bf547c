"""Configs that cannot start, learned rather than retried: a nearest-neighbour model of
start failures over the trials the store already ran on the same engine version and
hardware (and this study's own), the way SCOOT learns configs that fail to start.

A sample the model predicts to fail is not started: it is told to Optuna as a failed
constraint (reason ``predicted_failure``, with the predicted reason), so the sampler
learns to keep away, and it does not count toward ``--trials``. The sampler still gets
its way when it insists: a config it proposes again after being steered away, or the
next sample after :data:`MAX_STEERED_IN_A_ROW` steered in a row, is started, and what it
does is the model's hit or miss (the study's end reports the hit rate).
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.store import A, FailureReason
from autotune.study._budget import same_engine_trials

if TYPE_CHECKING:
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial

    from autotune.space import SearchSpace

logger = logging.getLogger(__name__)

#: reasons that say the config could not start (the model's positives)
START_FAILURES = frozenset({FailureReason.OOM, FailureReason.INVALID_CONFIG,
                            FailureReason.CRASH, FailureReason.START_TIMEOUT})
#: states of a trial whose server started (the model's negatives)
STARTED = frozenset({"ok", "infeasible", "pruned"})
K = 5  # neighbours a prediction looks at
NEAR = 0.25  # mean per-knob distance within which a trial counts as a neighbour
THRESHOLD = 0.6  # weighted share of failing neighbours that predicts a failure
MAX_STEERED_IN_A_ROW = 3  # then the next sample runs whatever the model says


@dataclass(frozen=True)
class Prediction:
    """The model's word on a config: its failure share among ``neighbours`` similar
    trials and the reason most of the failing ones gave."""

    fail: bool
    p_fail: float
    reason: str | None
    neighbours: int

    def text(self) -> str:
        return (f"predicted to fail to start ({self.reason}: {self.p_fail:.0%} of "
                f"{self.neighbours} similar earlier trial(s) failed so)")


@dataclass
class FailureModel:
    """Trials seen (params, failure reason or None for a start) and the distance over the
    space's knobs; :meth:`predict` is a weighted vote of the nearest of them."""

    space: SearchSpace
    seen: list[tuple[dict[str, Any], str | None]] = field(default_factory=list)
    earlier: int = 0  # of ``seen``: from earlier studies
    studies: int = 0
    # the hit rate: started configs predicted to fail, and those that did
    predicted_ran: int = 0
    predicted_failed: int = 0
    missed: int = 0  # start failures predicted to start
    steered: Counter[str] = field(default_factory=Counter)
    _tried: set[str] = field(default_factory=set)
    _in_a_row: int = 0

    def add(self, params: Mapping[str, Any], reason: str | None) -> None:
        """A trial that started (``reason`` None) or failed to start (its reason)."""
        self.seen.append((dict(params), reason))

    def distance(self, a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
        """Mean over the knobs of 0 (same) to 1 (most apart; a knob set in one and not the
        other counts 1); numbers by their share of the knob's range (log range for a log
        knob)."""
        names = set(a) | set(b)
        if not names:
            return 0.0
        return sum(self._knob_distance(n, a.get(n), b.get(n)) for n in names) / len(names)

    def _knob_distance(self, name: str, x: Any, y: Any) -> float:
        if x is None or y is None:
            return 0.0 if x is y else 1.0
        knob = self.space.knobs.get(name)
        numeric = (knob is not None and knob.type in ("int", "float") and knob.low is not None
                   and knob.high is not None and knob.high > knob.low)
        if (not numeric or knob is None or knob.low is None or knob.high is None
                or isinstance(x, (bool, str)) or isinstance(y, (bool, str))):
            return 0.0 if x == y else 1.0
        lo, hi, fx, fy = float(knob.low), float(knob.high), float(x), float(y)
        if knob.log and lo > 0 and fx > 0 and fy > 0:
            lo, hi, fx, fy = math.log(lo), math.log(hi), math.log(fx), math.log(fy)
        return min(1.0, abs(fx - fy) / (hi - lo))

    def predict(self, params: Mapping[str, Any]) -> Prediction:
        """Fail when the distance-weighted share of start failures among the K nearest
        trials within :data:`NEAR` reaches :data:`THRESHOLD` (and two of them failed)."""
        near = sorted(((self.distance(params, p), reason) for p, reason in self.seen),
                      key=lambda dr: dr[0])  # ties: in the order seen (reasons do not sort)
        near = [(d, r) for d, r in near[:K] if d <= NEAR]
        if not near:
            return Prediction(False, 0.0, None, 0)
        weights = [(1.0 / (d + 0.05), r) for d, r in near]
        total = sum(w for w, _ in weights)
        failing = [(w, r) for w, r in weights if r is not None]
        p = sum(w for w, _ in failing) / total
        votes: Counter[str] = Counter()
        for w, r in failing:
            votes[str(r)] += int(w * 1000)
        reason = votes.most_common(1)[0][0] if votes else None
        return Prediction(p >= THRESHOLD and len(failing) >= 2, p, reason, len(near))

    def steer(self, params: Mapping[str, Any]) -> tuple[Prediction, bool]:
        """The prediction and whether to steer the sample away (not start it). The sampler
        insists, and the sample runs, when it proposed this config before or after
        :data:`MAX_STEERED_IN_A_ROW` steered samples in a row."""
        pred = self.predict(params)
        key = json.dumps(dict(params), sort_keys=True, default=str)
        if not pred.fail or key in self._tried or self._in_a_row >= MAX_STEERED_IN_A_ROW:
            self._in_a_row = 0
            return pred, False
        self._tried.add(key)
        self._in_a_row += 1
        self.steered[str(pred.reason)] += 1
        return pred, True

    def outcome(self, params: Mapping[str, Any], reason: str | None, *,
                predicted: bool) -> None:
        """A started sample's result: learned from, and scored against its prediction."""
        failed = reason is not None
        if predicted:
            self.predicted_ran += 1
            self.predicted_failed += failed
        elif failed:
            self.missed += 1
        self.add(params, reason)

    def intro(self) -> str:
        """The study's first word on the model: what it learned from."""
        fails = sum(1 for _, r in self.seen if r is not None)
        if not self.seen:
            return ("failure model: no earlier trial on this engine and hardware in the store; "
                    "it learns from this study's start failures as they come")
        return (f"failure model: {len(self.seen)} earlier trial(s) of {self.studies} stud"
                f"{'y' if self.studies == 1 else 'ies'} on this engine and hardware, {fails} "
                "of them start failures: samples near those are steered away")

    def summary(self) -> str:
        """The study's last word on the model: what it steered away and its hit rate."""
        steered = sum(self.steered.values())
        text = (f"failure model ({self.earlier} earlier trial(s) of {self.studies} stud"
                f"{'y' if self.studies == 1 else 'ies'} on this engine and hardware): "
                f"steered {steered} sample(s) away")
        if steered:
            text += " (" + ", ".join(f"{r} {n}" for r, n in self.steered.most_common()) + ")"
        if self.predicted_ran:
            text += (f"; of {self.predicted_ran} predicted failure(s) the sampler insisted "
                     f"on, {self.predicted_failed} failed (hit rate "
                     f"{self.predicted_failed / self.predicted_ran:.0%})")
        else:
            text += "; no predicted failure ran, so no hit rate yet"
        return text + f"; start failures it did not predict: {self.missed}"

    def record(self) -> dict[str, int]:
        """``autotune.failure_model``: the counts :meth:`summary` speaks of."""
        return {"earlier_trials": self.earlier, "studies": self.studies,
                "steered": sum(self.steered.values()), "predicted_ran": self.predicted_ran,
                "predicted_failed": self.predicted_failed, "missed": self.missed}


def label(t: FrozenTrial) -> tuple[bool, str | None]:
    """(usable, reason): a trial that started (None) or failed to start (its reason);
    unusable: rejected samples, stopped trials, copies of other studies' trials."""
    attrs = t.user_attrs
    if attrs.get(A.PRIOR) or not t.params:
        return False, None
    reason = attrs.get(A.REASON)
    if reason in START_FAILURES:
        return True, str(reason)
    return attrs.get(A.STATE) in STARTED, None


def failure_model(space: SearchSpace, storage: BaseStorage, *, engine: str, gpu: str,
                  exclude: str | None = None) -> FailureModel:
    """A model trained on the trials of the store's studies recorded with the same engine
    version and hardware (``autotune.engine_version``, ``autotune.gpu_type``), ``exclude``
    (this study) left out: its own trials are added as they finish."""
    model = FailureModel(space=space)
    for trials in same_engine_trials(storage, engine=engine, gpu=gpu, exclude=exclude):
        n = 0
        for t in trials:
            usable, reason = label(t)
            if usable:
                model.add(t.params, reason)
                n += 1
        model.earlier += n
        model.studies += n > 0
    return model
