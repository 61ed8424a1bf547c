"""Warm starts: the best trials of earlier studies of a shape, fitted to a new space and
enqueued as the first trials of a retune.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.errors import StudyError
from autotune.store import (
    A,
    FailureReason,
    feasible,
    is_prior,
    objective_metric,
    primary,
    verdict,
)
from autotune.traffic import TrafficShape

if TYPE_CHECKING:
    from typing import TypeAlias

    import optuna

    from autotune.space import SearchSpace

    #: An Optuna storage URL, or a storage already opened (saves a schema check per call).
    StorageLike: TypeAlias = "str | optuna.storages.BaseStorage"
from autotune.config import SLO_KEYS
from autotune.results._registry import (
    _NOT_COPIED,
    PRIOR_ATTR,
    RetunePlan,
    WarmStart,
    _filter,
    _find,
    _load_study,
    _open,
    _resolve,
    _scan,
    _tuned_shape,
)

logger = logging.getLogger(__name__)


def _fit_to_space(params: dict[str, Any], dists: dict[str, Any],
                  space: SearchSpace | None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Params and distributions re-expressed in ``space``; None when they no longer fit it.

    Optuna refuses a parameter whose distribution kind (or categorical choices) changed
    within one study, so a prior trial takes the new space's distribution when its value
    is inside it, and is dropped otherwise.
    """
    if space is None:
        return dict(params), dict(dists)
    new_p: dict[str, Any] = {}
    new_d: dict[str, Any] = {}
    for name, value in params.items():
        knob = space.knobs.get(name)
        if knob is None or not knob.contains(value):
            return None
        dist = knob.distribution()
        try:  # also checks an int knob's step, which Knob.contains does not
            inside = bool(dist._contains(dist.to_internal_repr(value)))
        except (ValueError, TypeError):
            inside = False
        if not inside:
            return None
        new_p[name], new_d[name] = value, dist
    return new_p, new_d


def warm_start_from(
    storage: StorageLike, study_name: str, *, top_k: int = 3, space: SearchSpace | None = None,
    value_scale: float = 1.0, objective: str | None = None, pareto_latency: str = "ttft_p99",
    include_baseline: bool = False,
) -> WarmStart:  # fmt: skip
    """A :class:`WarmStart` from study ``study_name`` in ``storage``.

    ``enqueue``: the params of its ``top_k`` best feasible configs (ranked by the median of
    their readings), the baseline left out (a new study measures vLLM's defaults itself)
    unless ``include_baseline`` (for a new study run without its baseline: the old defaults,
    when they rank among the top, are marked in ``enqueue_baseline`` and run as the new
    study's baseline). ``prior_trials``: its COMPLETE and PRUNED trials (failed starts and
    rejected samples included: they are what the sampler learns to avoid; FAIL = tuner died,
    no information) with their constraints.

    The choice about values: a prior trial keeps the objective value it had, measured under
    the *old* shape, multiplied by ``value_scale`` (pass new/old throughput of a reference
    config if known). TPE uses values only to rank trials into "good" and "bad", so what
    carries over is which regions were good or failed; because prior trials are added first,
    TPE's default weights down-weight them once the new study has more than 25 trials. If
    the new shape is much slower overall, raw old values outrank every new trial for a while
    and keep the search near the old optimum; that is the intended warm-start bias, and
    ``value_scale`` removes it when a ratio is known.

    ``space`` (the new study's space) keeps only what fits it: priors with a knob it lacks or
    a value outside a knob are dropped, the rest take its distributions; enqueued configs
    must also pass its rules.

    ``objective`` (the new study's: throughput, goodput or pareto with ``pareto_latency``):
    the priors' values are read from their measured metrics for that objective, so a study
    of another objective can warm-start this one (measured trials without the metric are
    left out); None keeps the values as stored (the same objective). Constraints (SLO and
    error-rate verdicts) carry over as the earlier study recorded them.
    """
    url, st = _resolve(storage)
    return _warm_start(url, study_name, top_k=top_k, space=space, value_scale=value_scale,
                       objective=objective, pareto_latency=pareto_latency, st=st,
                       include_baseline=include_baseline)


def _prior_values(t: Any, objective: str | None, latency: str,
                  scale: float) -> list[float] | None:
    """A COMPLETE trial's values for the new study (throughput scaled); None = unusable."""

    if objective is None:
        vals = [float(v) for v in t.values]
    else:
        metrics = dict(t.user_attrs.get(A.METRICS, {}))
        keys = [objective_metric(objective)] + ([SLO_KEYS[latency]] if objective == "pareto"
                                                else [])
        raw = [metrics.get(k) for k in keys]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in raw):
            return None
        vals = [float(v) for v in raw]  # type: ignore[arg-type]
    if not all(math.isfinite(v) for v in vals):
        return None
    return [vals[0] * scale, *vals[1:]]


def _warm_start(storage: str, study_name: str, *, top_k: int, space: SearchSpace | None,
                value_scale: float, objective: str | None = None,
                pareto_latency: str = "ttft_p99", st: Any | None = None,
                include_baseline: bool = False, weight: float | None = None) -> WarmStart:
    import optuna
    from optuna.trial import TrialState

    if top_k < 0:
        raise StudyError(f"--top-k {top_k}: must be >= 0")
    if not math.isfinite(value_scale) or value_scale <= 0:
        raise StudyError(f"value_scale {value_scale}: must be a positive, finite number")
    st = st if st is not None else _open(storage)
    if st is None:
        raise StudyError(f"no Optuna storage at {storage}; nothing to warm-start from")
    names = [s.study_name for s in st.get_all_studies()]
    if study_name not in names:
        raise StudyError(
            f"study {study_name!r} is not in {storage}; known studies: "
            f"{', '.join(sorted(names)) or 'none'}"
        )
    study = _load_study(st, study_name)
    fp = str(study.user_attrs.get(A.SHAPE, ""))
    trials = study.get_trials(deepcopy=False)

    # configs (not the baseline, unless asked): the one the study declared best first (the
    # verdict's rule, as best.json names it), then the rest by the median of their readings
    groups: dict[str, list[Any]] = {}
    for t in trials:
        if feasible(t) and (include_baseline or not t.user_attrs.get(A.BASELINE)):
            groups.setdefault(json.dumps(t.params, sort_keys=True, default=str), []).append(t)
    declared = verdict(study).winner
    first = json.dumps(declared.params, sort_keys=True, default=str) if declared else None
    ranked = sorted(groups.items(), key=lambda kv: (kv[0] == first,
                                                    statistics.median(primary(t) for t in kv[1])),
                    reverse=True)
    enqueue: list[dict[str, Any]] = []
    origin: list[int] = []
    was_base: list[bool] = []
    for _, ts in ranked:
        if len(enqueue) >= top_k:
            break
        t = min(ts, key=lambda u: u.number)
        fitted = _fit_to_space(dict(t.params), dict(t.distributions), space)
        if fitted is None or (space is not None and space.violations(fitted[0])):
            logger.info("warm start: trial %d of %s does not fit the new space", t.number,
                        study_name)
            continue
        enqueue.append(fitted[0])
        origin.append(t.number)
        was_base.append(bool(t.user_attrs.get(A.BASELINE)))

    priors: list[optuna.trial.FrozenTrial] = []
    dropped = 0
    for t in trials:
        if (t.state not in (TrialState.COMPLETE, TrialState.PRUNED) or is_prior(t)
                or t.user_attrs.get(A.REASON) == FailureReason.PREDICTED):
            continue  # a predicted failure is the model's guess, not a reading
        fitted = _fit_to_space(dict(t.params), dict(t.distributions), space)
        if fitted is None:
            dropped += 1
            continue
        attrs = {k: v for k, v in t.user_attrs.items() if k not in _NOT_COPIED}
        attrs[PRIOR_ATTR] = {"study": study_name, "trial": t.number, "shape_fingerprint": fp,
                             "baseline": bool(t.user_attrs.get(A.BASELINE)),
                             "value_scale": value_scale}
        if weight is not None:  # the sampler's weight of this observation (learn_from_store)
            attrs[PRIOR_ATTR]["weight"] = weight
        system = {k: v for k, v in t.system_attrs.items()
                  if not k.startswith("constraints") and k != "fixed_params"}
        values = None
        if t.state == TrialState.COMPLETE:
            values = _prior_values(t, objective, pareto_latency, value_scale)
            if values is None:
                dropped += 1
                continue
        try:
            priors.append(optuna.trial.create_trial(
                state=t.state, values=values, params=fitted[0], distributions=fitted[1],
                user_attrs=attrs, system_attrs=system, constraints=dict(t.constraints) or None,
            ))  # fmt: skip
        except ValueError as exc:
            dropped += 1
            logger.info("warm start: trial %d of %s cannot be copied: %s", t.number,
                        study_name, exc)
    if dropped:
        logger.info("warm start: %d trial(s) of %s left out (outside the new space, or no "
                    "measured value for the new objective)", dropped, study_name)
    return WarmStart(enqueue=enqueue, prior_trials=priors, source_study=study_name,
                     source_shape_fingerprint=fp, enqueue_from=origin,
                     enqueue_baseline=was_base)


def plan_retune(
    *, storage: StorageLike, shape: TrafficShape, model: str | None = None,
    gpu: str | None = None, top_k: int = 3, space: SearchSpace | None = None, force: bool = False,
    objective: str | None = None, pareto_latency: str = "ttft_p99",
    include_baseline: bool = False,
) -> RetunePlan | None:  # fmt: skip
    """Compare ``shape`` with the shape the current best config was tuned for.

    The "current best" is :func:`find_best`'s hit for this model (and GPU): the exact
    fingerprint, else the nearest tuned shape, so a shape close to *any* tuned one reuses
    its config. Returns None when nothing was tuned for this model. When the shape drifted
    (or ``force``), ``warm_start`` comes from the hit's study (:func:`warm_start_from`, with
    the new study's ``objective``; ``include_baseline`` when the new study has no baseline).
    """
    url, st = _resolve(storage)
    found = _find(url, shape, model, gpu, st) if st is not None else None
    if found is None:
        return None
    hit, diff = found
    drifted = diff is not None and diff.verdict == "drifted"
    ws = None
    if drifted or force:
        ws = _warm_start(url, hit.study, top_k=top_k, space=space, value_scale=1.0,
                         objective=objective, pareto_latency=pareto_latency, st=st,
                         include_baseline=include_baseline)
    return RetunePlan(hit=hit, diff=diff, drifted=drifted, warm_start=ws)


@dataclass(frozen=True)
class Learned:
    """What a new study learns from the earlier studies in its store
    (:func:`learn_from_store`): their trials as weighted prior observations, and per study
    (name, trials taken, shape distance, weight)."""

    prior_trials: list[optuna.trial.FrozenTrial]
    sources: list[tuple[str, int, float, float]]
    skipped: list[str]

    def line(self) -> str:
        """The study's first word on it."""
        if not self.sources:
            why = f" ({'; '.join(self.skipped[:3])})" if self.skipped else ""
            return ("learned from no earlier study: none in the store on this model and "
                    f"hardware with trials that fit this space{why}")
        parts = ", ".join(f"{name} ({n} trial(s), shape distance {d:.2f}, weight {w:.2f})"
                          for name, n, d, w in self.sources)
        return (f"learned from {len(self.prior_trials)} earlier trial(s) of "
                f"{len(self.sources)} stud{'y' if len(self.sources) == 1 else 'ies'}, each "
                f"reading weighted by how near its shape is to this one: {parts}")


def shape_weight(distance: float) -> float:
    """An earlier study's weight by its shape's distance to this one (the RMS of distance /
    threshold over the shape's dimensions, autotune.traffic.diff_shapes: <= 1 reads "the
    same"): 1 for the same shape, 0.5 at the drift threshold, 0.1 at three times it."""
    return 1.0 / (1.0 + distance * distance)


def learn_from_store(storage: StorageLike, *, shape: TrafficShape, model: str, gpu: str,
                     space: SearchSpace, objective: str, exclude: Collection[str] = (),
                     min_weight: float = 0.05) -> Learned:
    """The trials of every earlier study in ``storage`` on the same ``model`` and ``gpu``
    (any shape, any space whose trials fit ``space``; ``exclude``: studies left out), as
    prior observations for a new study: their readings for ``objective`` as measured (see
    :func:`warm_start_from` on values of another shape), each study's weighted by
    :func:`shape_weight` of its shape's distance (``autotune.prior`` ``weight``: the
    sampler scales its observations by it); studies below ``min_weight``, or whose shape
    file cannot be read back, are skipped (``skipped`` says why)."""
    from autotune.traffic import diff_shapes

    url, st = _resolve(storage)
    if st is None:
        return Learned([], [], [])
    priors: list[optuna.trial.FrozenTrial] = []
    sources: list[tuple[str, int, float, float]] = []
    skipped: list[str] = []
    cache: dict[str, TrafficShape | str] = {}
    for info, _ in _filter(_scan(url, st), model, gpu):
        if info.name in exclude:
            continue
        if info.shape_fingerprint == shape.fingerprint:
            distance = 0.0
        else:
            tuned = _tuned_shape(info, cache)
            if isinstance(tuned, str):
                skipped.append(tuned)
                continue
            distance = diff_shapes(tuned, shape).distance
        weight = shape_weight(distance)
        if weight < min_weight:
            skipped.append(f"study {info.name}: shape distance {distance:.2f} (weight "
                           f"{weight:.2f} < {min_weight:g})")
            continue
        ws = _warm_start(url, info.name, top_k=0, space=space, value_scale=1.0,
                         objective=objective, st=st, weight=round(weight, 4))
        if ws.prior_trials:
            priors += ws.prior_trials
            sources.append((info.name, len(ws.prior_trials), distance, weight))
    return Learned(priors, sources, skipped)
