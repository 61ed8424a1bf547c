"""The verdict of a study: the best config against vLLM's defaults, with the interval of
the ratio (re-check starts pooled), and the Pareto front of a latency objective.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, NotRequired, TypedDict

from autotune.errors import clip_command
from autotune.store._keys import _METRICS, A, State, interval_keys
from autotune.store._trials import feasible, primary, readings, server_gpus_of

if TYPE_CHECKING:
    from optuna.study import Study
    from optuna.trial import FrozenTrial

    from autotune.events import ParamValue
    from autotune.measure._stats import Interval, RatioBound, RatioInterval
    from autotune.store._spread import StoredSpread

logger = logging.getLogger(__name__)


class Verdict(NamedTuple):
    """The config a study declares (the winner, or vLLM's defaults when no config is shown
    to beat them) and the defaults, each with the readings the verdict used."""

    winner: FrozenTrial | None  # the reading closest to the declared config's median
    readings: list[float]
    baseline: FrozenTrial | None  # the first reading of vLLM's defaults
    baseline_readings: list[float]


@dataclass(frozen=True)
class Judgement:
    """The study's verdict and the readings (trials) behind it."""

    # "winner" | "unconfirmed" (a lead from one server start each: best.json keeps the
    # defaults) | "defaults_best" | "unverified" (no defaults measured)
    verdict: str
    reason: str
    ratio: RatioInterval | None
    declared: list[FrozenTrial]  # readings of the config best.json names
    candidate: list[FrozenTrial]  # readings of the best config other than the defaults
    defaults: list[FrozenTrial]  # readings of the defaults
    # when no other config was measured feasible: the best one the pruner stopped (its
    # within-run figures give the ratio; it has no objective value of its own)
    pruned: FrozenTrial | None = None
    # defaults_best with a ratio above 1 that the starts could not show: how many starts
    # of each config would, at the measured start-to-start spread (autotune.stats.
    # starts_needed), and the --recheck-starts that gives them
    starts_needed: int | None = None
    recheck_starts_needed: int | None = None
    # a capacity whose search found no failing level on one side: all the brackets say
    # (the ratio is at least / at most this); ``ratio`` is then None
    bound: RatioBound | None = None
    # one start each: the start-to-start spread from elsewhere that widened the interval,
    # in words ("start-to-start spread 9.0 % from 3 earlier studies on this host")
    prior_spread: str | None = None


def _fresh(ts: list[FrozenTrial]) -> list[FrozenTrial]:
    return [t for t in ts if t.user_attrs.get(A.RECHECK_OF) is not None]


def study_objective(study: Study) -> str:
    """The objective a study maximises (its stored settings; throughput when unknown)."""
    settings = study.user_attrs.get(A.SETTINGS) or {}
    objective = settings.get("objective") if isinstance(settings, dict) else None
    return str(objective) if objective in _METRICS else "throughput"


def _within(ts: list[FrozenTrial]) -> Interval | None:
    """The within-run interval of a config's first reading (autotune.stats.Interval):
    its output tokens/s."""
    from autotune.measure._stats import Interval

    m = ts[0].user_attrs.get(A.METRICS) or {}
    lo, hi = m.get("output_tokens_per_s_ci_low"), m.get("output_tokens_per_s_ci_high")
    if lo is None or hi is None:
        return None
    n = server_gpus_of(ts[0])  # the value is per GPU; the metrics are the server's
    return Interval(primary(ts[0]), lo / n, hi / n)


def _brackets(ts: list[FrozenTrial]) -> list[Interval]:
    """Each capacity reading's bracket per GPU, [highest pass, lowest fail]: ``high`` inf
    when no level failed (the search stopped at its time cap, level budget or top scale:
    the capacity is at least ``low``, and nothing bounds it above)."""
    from autotune.measure._stats import Interval

    out = []
    for t in ts:
        m = t.user_attrs.get(A.METRICS) or {}
        lo, hi = (m.get(k) for k in interval_keys("capacity"))
        n, v = server_gpus_of(t), primary(t)  # the value is per GPU; the metrics the server's
        low = lo / n if isinstance(lo, (int, float)) and lo > 0 else v
        high = (hi / n if isinstance(hi, (int, float)) and math.isfinite(hi) and hi > 0
                else math.inf)
        out.append(Interval(v, low, high))
    return out


#: a capacity search's status (``autotune.capacity``) -> where it ended without a failing
#: level, and what measures beyond it
_CUT = {
    "time": ("its time cap (--capacity-max-s)",
             "leave --capacity-max-s out (the search then runs until its bracket is within "
             "--capacity-tolerance) or raise it"),
    "levels": ("its level budget (--capacity-max-levels)", "raise --capacity-max-levels"),
    "capped": ("its top scale (64x the recorded rate, or --capacity-start when higher)",
               "start the search higher (--capacity-start {start:g}: the search's top is "
               "then that scale) or replay a faster copy of the shape ({faster})"),
}
_CUT_UNKNOWN = ("its time cap or its top scale (not recorded which)",
                "raise --capacity-max-s or --capacity-start")


def capacity_cut(status: str | None, *, top: float | None = None,
                 shape_path: str | None = None) -> tuple[str, str]:
    """(where a capacity search that found no failing level ended, what measures beyond
    it) for its ``autotune.capacity`` status: ``time``, ``levels`` or ``capped``.
    ``top``: the scale a capped search passed at (64 when not known); ``shape_path``: the
    shape's file, so that the clip command the fix gives runs as printed."""
    where, fix = _CUT.get(str(status or ""), _CUT_UNKNOWN)
    if status != "capped":
        return where, fix
    scale = top if top is not None and math.isfinite(top) and top > 0 else 64.0
    faster = (clip_command(shape_path, rate_scale=scale) if shape_path is not None
              else f"its file through 'autotune shape clip' with --rate-scale {scale:g}")
    # a search's top scale is max(64, its start): 4x the top passed gives room above it
    return where, fix.format(start=scale * 4, faster=faster)


def _cut_short(t: FrozenTrial, bracket: Interval) -> bool:
    """A capacity reading whose search was cut short: no failing level (an open bracket), or
    a cap (time, levels) that ended it before its bracket was within the tolerance."""
    status = (t.user_attrs.get(A.CAPACITY) or {}).get("status")
    return not math.isfinite(bracket.high) or status in ("time", "levels")


def _open_reason(cut: list[FrozenTrial], bound: RatioBound | None,
                 allowed: tuple[float, float] | None = None,
                 shape_path: str | None = None) -> str:
    """Why a capacity verdict has no ratio: which trials' searches were cut short, where,
    the bound (or range) the brackets still give, and what measures beyond them
    (``shape_path``: the study's shape file, named in the clip command)."""
    from autotune.measure._stats import fmt_ratio

    where: dict[tuple[str, str], list[int]] = {}
    for t in cut:
        cap = t.user_attrs.get(A.CAPACITY) or {}
        top = cap.get("low") if isinstance(cap.get("low"), (int, float)) else None
        where.setdefault(capacity_cut(cap.get("status"), top=top, shape_path=shape_path),
                         []).append(t.number)
    ends = "; ".join(f"trial{'s' if len(ns) > 1 else ''} {', '.join(map(str, sorted(ns)))} at "
                     f"{at}" for (at, _), ns in where.items())
    fixes = "; ".join(dict.fromkeys(fix for _, fix in where))
    if bound is not None:
        says = (f"the brackets say only that the ratio is "
                f"{bound.kind.replace('_', ' ')} {fmt_ratio(bound.value)}")
    elif allowed is not None:
        says = (f"the brackets allow any ratio from {fmt_ratio(allowed[0])} to "
                f"{fmt_ratio(allowed[1])}")
    else:
        says = "nothing bounds the ratio (both sides' capacities have no top)"
    return (f"no ratio to the defaults: a capacity search was cut short before its bracket "
            f"was within the tolerance ({ends}), and a search cut short ranks nothing "
            f"however many starts agree: {says}, and no winner comes from it; to measure "
            f"it, {fixes}: vLLM's defaults remain best")


def _allowed(config: list[Interval], defaults: list[Interval]) -> tuple[float, float] | None:
    """Every ratio two sides' closed brackets allow (geometric means over their starts)."""
    if any(not (iv.low > 0 and math.isfinite(iv.high)) for iv in (*config, *defaults)):
        return None

    def gm(xs: list[float]) -> float:
        return math.exp(statistics.fmean(math.log(x) for x in xs))

    return (gm([iv.low for iv in config]) / gm([iv.high for iv in defaults]),
            gm([iv.high for iv in config]) / gm([iv.low for iv in defaults]))


def judge_study(study: Study, *, prior: StoredSpread | None = None) -> Judgement | None:
    """The verdict (docs/measurement.md): the best re-checked config against the defaults.

    When the re-check ran, only its fresh-server readings count (a search reading was
    picked for being high), unless every measured config was re-checked: then nothing was
    picked and the search readings count too (one more start per config). Otherwise the
    start-to-start spread is pooled over every config's starts, search readings included:
    with one fresh start each (``--recheck-starts 1``) it is the only measure of that
    spread (a capacity bracket is no noise estimate), with more it adds degrees of freedom.
    The candidate is the config with the best mean log reading.
    A winner is declared only if the 95 % interval of its ratio to the defaults lies
    above 1 and holds the start-to-start spread; a lead from one server start each is
    ``unconfirmed`` (best.json names the defaults until a re-check confirms it); otherwise
    the defaults remain best and best.json names them. None: no feasible trial.
    ``prior``: a start-to-start spread measured elsewhere (:func:`autotune.store.
    stored_spread`), which widens the interval of a verdict of one start each (said in
    ``prior_spread``)."""
    from autotune.measure._stats import (
        MAX_STARTS_NEEDED,
        bracket_bound,
        decide_verdict,
        fmt_ratio,
        ratio_to_defaults,
        starts_needed,
    )

    groups = list(readings(study).values())
    if not groups:
        return None
    objective = study_objective(study)
    base = next((ts for ts in groups if ts[0].user_attrs.get(A.BASELINE)), None)
    others = [ts for ts in groups if ts is not base]
    search_counts = all(_fresh(ts) for ts in groups)
    spread = None  # the groups the between-start variance is pooled over (None: the ones used)
    if search_counts:  # no selection: every reading is unbiased
        pool, base_use = others, (base or [])
    else:
        pool = [_fresh(ts) for ts in others if _fresh(ts)] or others
        base_use = (_fresh(base) or base) if base else []
        # the estimate stays fresh-only; the start-to-start spread is pooled over every
        # config's starts, search readings included (more degrees of freedom; a search
        # reading picked for being high only widens its config's spread)
        spread = [[primary(t) for t in ts] for ts in groups]
    cand = max(pool, key=lambda ts: statistics.fmean(
        math.log(max(primary(t), 1e-300)) for t in ts)) if pool else []
    if not base_use:
        return Judgement("unverified", "the defaults were not measured (--no-baseline): "
                         "nothing to compare with", None, cand, cand, [])
    if not cand:
        return _judge_pruned(study, base_use)
    brackets = None
    if objective == "capacity":
        cb, db = _brackets(cand), _brackets(base_use)
        cut = [t for t, iv in zip((*cand, *base_use), (*cb, *db), strict=True)
               if _cut_short(t, iv)]
        if cut:
            bound = bracket_bound(cb, db)
            allowed = _allowed(cb, db)
            path = study.user_attrs.get(A.SHAPE_PATH)
            reason = _open_reason(cut, bound, allowed,
                                  str(path) if isinstance(path, str) else None)
            return Judgement("defaults_best", reason, None,
                             base_use, cand, base_use, bound=bound)
        brackets = {"config": cb, "defaults": db}
    ratio = ratio_to_defaults([primary(t) for t in cand], [primary(t) for t in base_use],
                              others=[[primary(t) for t in ts] for ts in pool if ts is not cand],
                              within={"config": _within(cand), "defaults": _within(base_use)},
                              spread=spread, brackets=brackets,
                              prior=(prior.log_sd, prior.df) if prior is not None else None)
    v = decide_verdict(ratio)
    used = prior.source if prior is not None and ratio is not None and (
        ratio.prior_log_sd is not None) else None
    n = starts_needed(ratio) if v.verdict == "defaults_best" else None
    reason, recheck = v.reason, None
    if (v.verdict == "defaults_best" and ratio is not None and ratio.median > 1
            and ratio.log_sd is not None):
        at = f"; at the measured start-to-start SD ({math.expm1(ratio.log_sd) * 100:.1f} %)"
        if n is not None:
            # each config's re-check adds --recheck-starts fresh starts; its search reading
            # counts as one more start only when every config was re-checked
            recheck = n - 1 if search_counts else n
            reason += (f"{at} showing {fmt_ratio(ratio.median)} would take about {n} starts of "
                       f"each config (rerun with --resume --recheck-starts {recheck})")
        else:
            reason += (f"{at} more than {MAX_STARTS_NEEDED} starts of each config would not "
                       f"show {fmt_ratio(ratio.median)}")
    return Judgement(v.verdict, reason, ratio, cand if v.verdict == "winner" else base_use,
                     cand, base_use, starts_needed=n, recheck_starts_needed=recheck,
                     prior_spread=used)


def _pruned_value(t: FrozenTrial) -> float | None:
    """A pruned trial's output tokens/s per GPU (it has no objective value of its own)."""
    m = t.user_attrs.get(A.METRICS) or {}
    v = m.get("output_tokens_per_s")
    return (float(v) / server_gpus_of(t) if isinstance(v, (int, float)) and math.isfinite(v)
            and v > 0 else None)


def _judge_pruned(study: Study, base_use: list[FrozenTrial]) -> Judgement:
    """Defaults remain best when no other config was measured feasible; if the pruner
    stopped some, the best of them gives "the best ratio found" from its own segments."""
    from optuna.trial import TrialState

    from autotune.measure._stats import Interval, ratio_to_defaults

    pruned = [t for t in study.get_trials(deepcopy=False)
              if t.state == TrialState.PRUNED and t.user_attrs.get(A.STATE) == State.PRUNED
              and _pruned_value(t) is not None]
    reason = "no other config was measured feasible"
    if not pruned:
        return Judgement("defaults_best", reason, None, base_use, [], base_use)
    best = max(pruned, key=lambda t: _pruned_value(t) or 0.0)
    value = _pruned_value(best) or 0.0
    m = best.user_attrs.get(A.METRICS) or {}
    lo, hi = m.get("output_tokens_per_s_ci_low"), m.get("output_tokens_per_s_ci_high")
    n = server_gpus_of(best)
    iv = Interval(value, lo / n, hi / n) if lo is not None and hi is not None else None
    ratio = ratio_to_defaults([value], [primary(t) for t in base_use],
                              within={"config": iv, "defaults": _within(base_use)})
    return Judgement("defaults_best", reason + (
        f"; the pruner stopped the best other one (trial {best.number}) as a clear loser"),
        ratio, base_use, [], base_use, pruned=best)


def verdict(study: Study) -> Verdict:
    """The config best.json names (:func:`judge_study`): its reading nearest its median, its
    readings, and the defaults' first reading and readings."""
    j = judge_study(study)
    if j is None or not j.declared:
        return Verdict(None, [], None, [])
    vals = [primary(t) for t in j.declared]
    med = statistics.median(vals)
    rep = min(j.declared, key=lambda t: abs(primary(t) - med))
    base_rep = min(j.defaults, key=lambda t: t.number) if j.defaults else None
    return Verdict(rep, vals, base_rep, [primary(t) for t in j.defaults])


class VerdictRecord(TypedDict):
    """``verdict_record()``: the ``autotune.verdict`` study attribute. A study with no
    feasible trial has only the first five keys (the keys marked not required)."""

    verdict: str  # "winner" | "unconfirmed" | "defaults_best" | "unverified" | "none"
    ratio_to_defaults: dict[str, float] | None  # {"median", "ci_low", "ci_high"}
    winner_number: int | None
    baseline_number: int | None
    reason: str
    candidate_number: NotRequired[int | None]
    candidate_params: NotRequired[dict[str, ParamValue] | None]
    candidate_gpus: NotRequired[int | None]
    candidate_pruned: NotRequired[bool]
    # {"candidate": [...], "defaults": [...]} (a pruned candidate's reading may be None)
    readings: NotRequired[dict[str, list[float | None]]]
    method: NotRequired[str | None]
    # a capacity whose search found no failing level: {"kind": "at_least" | "at_most",
    # "value": x}, what the brackets still say (``ratio_to_defaults`` is then None)
    ratio_bound: NotRequired[dict[str, str | float] | None]
    start_spread: NotRequired[float | None]
    starts_needed: NotRequired[dict[str, int | None] | None]  # per_config, recheck_starts
    # the study adds the word on a lossy winner's quality (autotune.quality.quality_caveat)
    quality: NotRequired[dict[str, object] | None]
    # an unconfirmed lead: the command that re-checks it and the defaults on fresh servers
    # (the results add it: it names the study's files)
    confirm_command: NotRequired[str | None]
    # one start each: the spread from elsewhere that widened the interval, in words
    prior_spread: NotRequired[str | None]


def verdict_record(j: Judgement | None) -> VerdictRecord:
    """``autotune.verdict`` (study attribute, study.json, best.json's ``verdict``,
    ``ratio_to_defaults`` and ``verdict_detail``)."""
    if j is None:
        return {"verdict": "none", "ratio_to_defaults": None,
                "winner_number": None, "baseline_number": None,
                "reason": "no feasible trial"}
    cand_rep = (min(j.candidate, key=lambda t: t.number) if j.candidate else j.pruned)
    base_rep = min(j.defaults, key=lambda t: t.number) if j.defaults else None
    first = cand_rep.user_attrs.get(A.RECHECK_OF, cand_rep.number) if cand_rep else None
    return {
        "verdict": j.verdict,
        "ratio_to_defaults": j.ratio.as_dict() if j.ratio is not None else None,
        "winner_number": first if j.verdict in ("winner", "unverified") else None,
        "baseline_number": (base_rep.user_attrs.get(A.RECHECK_OF, base_rep.number)
                            if base_rep else None),
        "candidate_number": first,
        "candidate_params": dict(cand_rep.params) if cand_rep else None,
        # GPUs one server of the candidate uses (the readings are per GPU)
        "candidate_gpus": server_gpus_of(cand_rep) if cand_rep else None,
        "candidate_pruned": j.pruned is not None,
        "readings": {"candidate": ([primary(t) for t in j.candidate] if j.candidate else
                                   [_pruned_value(j.pruned)] if j.pruned is not None else []),
                     "defaults": [primary(t) for t in j.defaults]},
        "method": j.ratio.method if j.ratio is not None else None,
        "ratio_bound": j.bound.as_dict() if j.bound is not None else None,
        "start_spread": (math.expm1(j.ratio.log_sd)
                         if j.ratio is not None and j.ratio.log_sd is not None else None),
        "starts_needed": ({"per_config": j.starts_needed,
                           "recheck_starts": j.recheck_starts_needed}
                          if j.starts_needed is not None else None),
        "reason": j.reason,
        "prior_spread": j.prior_spread,
    }


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated when maximizing ``x`` and minimizing ``y``."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 >= x and y2 <= y) and (x2 > x or y2 < y) for j, (x2, y2) in enumerate(points)
            if j != i
        )  # fmt: skip
        if not dominated:
            front.append(i)
    return front


def pareto_trials(study: Study) -> list[FrozenTrial]:
    """Feasible trials no other feasible trial beats on both objectives, best first."""
    pts = [t for t in study.get_trials(deepcopy=False) if feasible(t) and len(t.values) == 2]
    front = [pts[i] for i in pareto_front([(t.values[0], t.values[1]) for t in pts])]
    return sorted(front, key=lambda t: -t.values[0])
