"""Clip or scale a shape's lengths and rate (``autotune shape clip``); pure."""

from __future__ import annotations

import numpy as np

from autotune.errors import ShapeError
from autotune.traffic._models import (
    LengthDist,
    PrefixStats,
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


def _grid(q: list[float]) -> np.ndarray:
    """A quantile function on a fine grid (what the replay samples from)."""
    a = np.asarray(q, dtype=np.float64)
    return np.interp(np.linspace(0, a.shape[0] - 1, 401), np.arange(a.shape[0]), a)


def _shared_share(p: PrefixStats, prompts: LengthDist, scale: float,
                  cap: int | None) -> float:
    """How the share of prompt tokens a cache serves changes when prompts (``prompts``)
    are multiplied by ``scale`` and capped at ``cap``: a sharing request's shared head is
    its ratio (``shared_prefix_ratio``) x its prompt, and a cap cuts the prompt's tail,
    so the head keeps ``min(ratio x prompt, cap)`` of a prompt of ``min(prompt, cap)``
    (ratio and length drawn independently, as the replay draws them). The factor, times
    the fitted share, is the clipped share: 1 without a cap."""
    if cap is None or p.shared_prefix_ratio is None:
        return 1.0
    length = _grid(prompts.quantiles) * scale
    ratio = _grid(p.shared_prefix_ratio)
    head = ratio[:, None] * length[None, :]
    before = head.mean() / max(length.mean(), 1e-9)
    after = np.minimum(head, cap).mean() / max(np.minimum(length, cap).mean(), 1e-9)
    return float(after / before) if before > 0 else 1.0


def _session_share(s: SessionStats, out_mean: float) -> float | None:
    """The share of prompt tokens a cache serves within sessions, from the mean prompt by
    turn (``context_by_turn``) and the share of sessions that reach each turn: a turn after
    the first finds its parent's prompt and answer cached. None without turns to tell."""
    by_turn = s.context_by_turn
    if len(by_turn) < 2:
        return None
    turns = _grid(s.turns.quantiles)
    reach = np.array([(turns >= t + 1 - 1e-9).mean() for t in range(len(by_turn))])
    total = float((reach * np.asarray(by_turn)).sum())
    cached = sum(reach[t] * min(by_turn[t], by_turn[t - 1] + out_mean)
                 for t in range(1, len(by_turn)))
    return float(cached / total) if total > 0 else None


def _clip_prefix(p: PrefixStats, *, scale: float, cap: int | None, prompts: LengthDist,
                 factor: float | None = None) -> PrefixStats:
    """A prefix section for prompts multiplied by ``scale`` and capped at ``cap``: its hash
    block scales with the prompts (a 512-token block at 1/32 is 16 tokens), its shared
    heads are scaled and capped, and its cacheable share is recomputed for the clipped
    lengths (``factor``, when given, is the ratio of the share after to the share before;
    else a cap's cut of the shared heads, :func:`_shared_share`)."""
    f = factor if factor is not None else _shared_share(p, prompts, scale, cap)
    update: dict[str, object] = {
        "shared_token_fraction": round(min(1.0, max(0.0, p.shared_token_fraction * f)), 6)}
    if p.block_tokens is not None:
        update["block_tokens"] = max(1, round(p.block_tokens * scale))
    if p.shared_prefix_tokens is not None:
        update["shared_prefix_tokens"] = _clip_dist(p.shared_prefix_tokens, scale=scale,
                                                    cap=cap)
    return p.model_copy(update=update)


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
    if shared is not None:
        shared = _clip_prefix(shared, scale=scale, cap=cap, prompts=s.first_turn_tokens)
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
    its shared-prefix lengths and hash block size are scaled with the prompts. The
    cacheable share (``prefix.shared_token_fraction``) is recomputed for the clipped
    lengths: a cap cuts shared heads; within sessions, answers not scaled with the prompts
    weigh more in the context a later turn finds cached."""
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
    out_after = out_dist if out_dist is not None else shape.output_tokens
    sessions = None
    if shape.sessions is not None and lengths:
        update["sessions"] = sessions = _clip_sessions(
            shape.sessions, s_in, max_input_tokens, shape.output_tokens.mean, out_after.mean)
    prefix = shape.prefix
    if prefix is not None and lengths:
        factor = None
        if prefix.source == "session" and shape.sessions is not None and sessions:
            # the share within sessions follows the clipped turns' prompts and answers
            before = _session_share(shape.sessions, shape.output_tokens.mean)
            after = _session_share(sessions, out_after.mean)
            factor = after / before if before and after is not None else None
        update["prefix"] = _clip_prefix(prefix, scale=s_in, cap=max_input_tokens,
                                        prompts=shape.input_tokens, factor=factor)
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
