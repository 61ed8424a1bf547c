"""Clip or scale a shape's lengths and rate (``autotune shape clip``); pure."""

from __future__ import annotations

import numpy as np

from autotune.errors import ShapeError
from autotune.traffic._models import (
    LengthDist,
    SessionStats,
    TrafficShape,
    compute_fingerprint,
)

__all__ = ["clip_shape"]


def _clip_dist(
    d: LengthDist, *, scale: float, cap: int | None, floor: float = 1.0
) -> LengthDist:
    q = np.asarray(d.quantiles, dtype=np.float64) * scale
    if cap is not None:
        q = np.minimum(q, cap)
    q = np.maximum(floor, np.round(q, 1))
    # mean and std of the piecewise-linear quantile function the replay samples from
    fine = np.interp(np.linspace(0, q.shape[0] - 1, 20_001), np.arange(q.shape[0]), q)
    qs = [float(v) for v in q]
    return LengthDist(mean=round(float(fine.mean()), 2), std=round(float(fine.std()), 2),
                      min=qs[0], p50=qs[50], p90=qs[90], p99=qs[99], max=qs[100], quantiles=qs)


def _clip_sessions(s: SessionStats, scale: float, cap: int | None, out_before: float,
                   out_after: float) -> SessionStats:
    """The sessions' prompt statistics for the clipped lengths: first turns and new tokens
    scaled and capped with the prompts (a turn's new tokens and growth may be 0, so they
    are not floored at 1 token); a turn's context growth (its new tokens and its parent's
    answer) and the mean prompt by turn have their answers' share moved from the mean
    output before (``out_before``) to the mean output after (``out_after``) rather than
    scaled as prompt tokens: ``scale x (growth - out_before) + out_after``."""
    shift = out_after - scale * out_before

    def grow(d: LengthDist | None, answers: float) -> LengthDist | None:
        if d is None:
            return None
        moved = d.model_copy(update={"quantiles": [
            v + answers / scale for v in d.quantiles]}) if answers else d
        return _clip_dist(moved, scale=scale, cap=cap, floor=0.0)

    def by_turn(t: int, v: float) -> float:  # turn t + 1 holds t earlier answers
        w = max(0.0, v * scale + t * shift)
        return round(min(w, cap) if cap is not None else w, 1)

    shared = s.shared_prefix
    if shared is not None and shared.shared_prefix_tokens is not None:
        shared = shared.model_copy(update={"shared_prefix_tokens": _clip_dist(
            shared.shared_prefix_tokens, scale=scale, cap=cap)})
    return s.model_copy(update={
        "shared_prefix": shared,
        "first_turn_tokens": _clip_dist(s.first_turn_tokens, scale=scale, cap=cap),
        "new_tokens": grow(s.new_tokens, 0.0),
        "context_growth": grow(s.context_growth, shift),
        "context_by_turn": [by_turn(t, v) for t, v in enumerate(s.context_by_turn)],
    })  # fmt: skip


def clip_shape(
    shape: TrafficShape,
    *,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    scale_lengths: float = 1.0,
    rate_scale: float = 1.0,
    name: str | None = None,
    scale_input: float = 1.0,
    scale_output: float = 1.0,
) -> TrafficShape:
    """``shape`` with lengths multiplied by ``scale_lengths`` then capped, and its replay
    rate multiplied by ``rate_scale`` (the load's time scale; the statistics keep the
    recorded rate). Changed lengths give a new fingerprint and, by default, a new name.

    ``scale_input`` / ``scale_output`` multiply only the prompt / output lengths (on top of
    ``scale_lengths``): a trace whose prompts are far longer than a server's context (the
    Mooncake conversation trace: prompt p50 6,909 tokens) keeps its output lengths, and
    its shared-prefix lengths are scaled with the prompts (their share stays the same)."""
    for label, v in (("max_input_tokens", max_input_tokens),
                     ("max_output_tokens", max_output_tokens)):
        if v is not None and v < 1:
            raise ShapeError(f"{label} must be >= 1 (got {v})")
    for label, f in (("scale_lengths", scale_lengths), ("rate_scale", rate_scale),
                     ("scale_input", scale_input), ("scale_output", scale_output)):
        if not (np.isfinite(f) and f > 0):
            raise ShapeError(f"{label} must be a number > 0 (got {f})")
    s_in, s_out = scale_lengths * scale_input, scale_lengths * scale_output
    lengths = (max_input_tokens is not None or max_output_tokens is not None
               or s_in != 1 or s_out != 1)
    update: dict[str, object] = {}
    # a side neither scaled nor capped keeps its fitted statistics as they are
    if s_in != 1 or max_input_tokens is not None:
        update["input_tokens"] = _clip_dist(shape.input_tokens, scale=s_in,
                                            cap=max_input_tokens)
    out_dist: LengthDist | None = None
    if s_out != 1 or max_output_tokens is not None:
        update["output_tokens"] = out_dist = _clip_dist(shape.output_tokens, scale=s_out,
                                                        cap=max_output_tokens)
    prefix = shape.prefix
    if prefix is not None and prefix.shared_prefix_tokens is not None and (
            s_in != 1 or max_input_tokens is not None):
        update["prefix"] = prefix.model_copy(update={"shared_prefix_tokens": _clip_dist(
            prefix.shared_prefix_tokens, scale=s_in, cap=max_input_tokens)})
    if shape.sessions is not None and lengths:
        out_after = out_dist if out_dist is not None else shape.output_tokens
        update["sessions"] = _clip_sessions(shape.sessions, s_in, max_input_tokens,
                                            shape.output_tokens.mean, out_after.mean)
    if rate_scale != 1:
        update["load"] = shape.load.model_copy(
            update={"time_scale": shape.load.time_scale / rate_scale})
    out = shape.model_copy(update=update)
    if lengths:
        out = out.model_copy(update={
            "fingerprint": compute_fingerprint(out.model_dump()),
            "name": name or f"{shape.name}-clipped",
        })  # fmt: skip
    elif name:
        out = out.model_copy(update={"name": name})
    return TrafficShape.model_validate(out.model_dump())
