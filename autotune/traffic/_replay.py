"""Turn a traffic shape into a request schedule for the load generator (pure, seeded).

Lengths are drawn from the shape's quantiles with its input/output rank correlation
(a Gaussian copula). Prompts are token ids of exactly the drawn length; output lengths are
enforced by the load generator (``max_tokens`` with ``ignore_eos``). Shared prefixes are
reproduced with a one-level group model; arrivals follow the recorded rate profile, a
burstiness-matched gamma process, or Poisson. See docs/traffic.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
from scipy.special import ndtr

from autotune.errors import TrafficError
from autotune.traffic._models import N_QUANTILES, TrafficShape

__all__ = [
    "ARRIVALS",
    "RequestSpec",
    "Schedule",
    "build_schedule",
    "busiest_stretch",
    "context_overflow",
    "ideal_prefix_hit_fraction",
]

logger = logging.getLogger(__name__)

ARRIVALS: Final = ("recorded", "gamma", "poisson")
Arrival = Literal["recorded", "gamma", "poisson"]
_GRID: Final = np.arange(N_QUANTILES, dtype=np.float64)
# timestamps this often tied are quantised: the gap CV measures rounding, not burstiness
_QUANTISED_ZERO_GAPS: Final = 0.5


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: exact prompt token ids, the output length to force, and when to send it."""

    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    send_at_s: float | None = None  # open loop: offset from the run's start; closed loop: None
    # chat API: the user message, built with the model's tokenizer (autotune.load) so the
    # server counts exactly len(prompt_token_ids) tokens; None: the ids as ``t<id>`` words
    prompt: str | None = None


@dataclass(frozen=True)
class Schedule:
    """What a replay sends. Closed loop: ``concurrency`` streams, each sending the next
    request when its previous one finished. Open loop: each request at ``send_at_s``
    (``concurrency`` then optionally caps requests in flight)."""

    mode: Literal["open", "closed"]
    requests: tuple[RequestSpec, ...]
    concurrency: int | None = None
    seed: int = 0

    def total_output_tokens(self) -> int:
        """Sum of ``max_tokens`` (the output tokens a complete replay produces)."""
        return sum(r.max_tokens for r in self.requests)

    def total_input_tokens(self) -> int:
        """Sum of the prompt lengths."""
        return sum(len(r.prompt_token_ids) for r in self.requests)


def _sample(quantiles: list[float], u: np.ndarray) -> np.ndarray:
    return np.interp(u * (N_QUANTILES - 1), _GRID, np.asarray(quantiles, dtype=np.float64))


def _lengths(
    shape: TrafficShape,
    n: int,
    rng: np.random.Generator,
    max_in: int | None,
    max_out: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    rho_s = shape.correlation.spearman if shape.correlation else None
    z = rng.standard_normal((2, n))
    if rho_s:
        # Spearman rho -> the Pearson r of the Gaussian copula with that rank correlation
        r = 2.0 * math.sin(math.pi * rho_s / 6.0)
        z[1] = r * z[0] + math.sqrt(max(0.0, 1.0 - r * r)) * z[1]
    u = ndtr(z)
    inp = np.maximum(1, np.rint(_sample(shape.input_tokens.quantiles, u[0]))).astype(np.int64)
    out = np.maximum(1, np.rint(_sample(shape.output_tokens.quantiles, u[1]))).astype(np.int64)
    if max_in is not None:
        inp = np.minimum(inp, max_in)
    if max_out is not None:
        out = np.minimum(out, max_out)
    return inp, out


def _replay_hits(shared: np.ndarray, group: np.ndarray, members: np.ndarray) -> float:
    """Tokens a perfect prefix cache serves when ``members`` (sorted) arrive in order: each
    request hits min(its shared length, the longest earlier one in its group)."""
    order = members[np.argsort(group[members], kind="stable")]
    g = group[order]
    s = shared[order].astype(np.float64)
    start = np.ones(order.shape[0], dtype=bool)
    start[1:] = g[1:] != g[:-1]
    prev_max = np.zeros_like(s)
    # running max of the earlier members of the same group (groups are contiguous here)
    for lo, hi in zip(np.flatnonzero(start), [*np.flatnonzero(start)[1:], s.shape[0]], strict=True):
        if hi - lo > 1:
            prev_max[lo + 1 : hi] = np.maximum.accumulate(s[lo : hi - 1])
    return float(np.minimum(s, prev_max).sum())


def _shared_lengths(
    shape: TrafficShape, inp: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Per request: leading tokens taken from its group's common prefix, and the group."""
    n = inp.shape[0]
    shared = np.zeros(n, dtype=np.int64)
    group = np.full(n, -1, dtype=np.int64)
    p = shape.prefix
    if p is None or p.sharing_request_fraction <= 0 or p.shared_prefix_ratio is None:
        return shared, group
    members = np.flatnonzero(rng.random(n) < p.sharing_request_fraction)
    ns = members.shape[0]
    if ns == 0:
        return shared, group
    n_groups = max(1, round(ns / max(p.mean_group_size, 1.0)))
    group[members] = rng.permutation(np.arange(ns) % n_groups)
    ratio = _sample(p.shared_prefix_ratio, np.asarray(rng.random(ns)))
    base = ratio * inp[members]
    # scale the shared lengths so the cache-hit share matches the recorded one
    target = p.shared_token_fraction * float(inp.sum())
    factor = 1.0
    for _ in range(6):
        shared[members] = np.clip(np.floor(base * factor), 0, inp[members])
        hits = _replay_hits(shared, group, members)
        if hits <= 0 or abs(hits - target) <= 0.005 * target:
            break
        factor *= target / hits
    return shared, group


def _prompts(
    shape: TrafficShape,
    inp: np.ndarray,
    rng_prefix: np.random.Generator,
    rng_tok: np.random.Generator,
    low: int,
    high: int,
    table: np.ndarray | None = None,
) -> list[tuple[int, ...]]:
    n = inp.shape[0]
    shared, group = _shared_lengths(shape, inp, rng_prefix)
    masters: dict[int, np.ndarray] = {}
    for g in np.unique(group[group >= 0]):
        length = int(shared[group == g].max())
        masters[int(g)] = rng_tok.integers(low, high, size=length, dtype=np.int64)
    tails = rng_tok.integers(low, high, size=int((inp - shared).sum()), dtype=np.int64)
    prompts: list[tuple[int, ...]] = []
    pos = 0
    span = high - low
    for i in range(n):
        k = int(shared[i])
        tail = tails[pos : pos + int(inp[i]) - k]
        pos += int(inp[i]) - k
        if k:
            master = masters[int(group[i])]
            if tail.shape[0] and k < master.shape[0] and tail[0] == master[k]:
                tail = tail.copy()  # make the shared part end exactly at k tokens
                tail[0] = low + (tail[0] - low + 1) % span
            ids = np.concatenate((master[:k], tail))
        else:
            ids = tail
        if table is not None:
            ids = table[ids]
        prompts.append(tuple(ids.tolist()))
    return prompts


def _burstiness_cv(shape: TrafficShape) -> float:
    a = shape.arrivals
    if a is None:
        return 1.0
    if a.zero_gap_fraction < _QUANTISED_ZERO_GAPS and a.interarrival_cv is not None:
        return a.interarrival_cv
    if a.dispersion_60s is not None:
        # a renewal process's count dispersion tends to CV^2
        return math.sqrt(a.dispersion_60s)
    return 1.0


def busiest_stretch(profile: Sequence[float], window_s: float, count: float) -> float:
    """Where the busiest stretch of a recorded rate profile that holds ``count`` expected
    arrivals begins, in expected arrivals from the profile's start: the stretch of the
    shortest duration (the highest mean rate), the profile taken as repeating (a stretch may
    wrap around its end). 0 when ``count`` holds the whole profile or more.

    A capacity level replays this stretch: whatever its number of requests, it meets the
    recording's worst burst at that size instead of whichever windows the profile starts
    with (a quiet first minute read a bursty trace's capacity high)."""
    prof = np.maximum(np.asarray(profile, dtype=np.float64), 1e-12)
    per = prof * window_s
    total = float(per.sum())
    if not (count > 0 and window_s > 0) or count >= total * (1 - 1e-9):
        return 0.0
    cum = np.concatenate(([0.0], np.cumsum(np.tile(per, 2))))  # twice: stretches that wrap
    edges = np.arange(cum.size, dtype=np.float64) * window_s
    # for a piecewise-constant rate the shortest stretch starts or ends on a window's edge
    starts = cum[: prof.size]
    from_start = np.interp(starts + count, cum, edges) - edges[: prof.size]
    ends = np.arange(1, cum.size)
    begin = cum[ends] - count
    ok = (begin >= 0) & (begin < total)
    to_end = edges[ends][ok] - np.interp(begin[ok], cum, edges)
    i, j = int(np.argmin(from_start)), int(np.argmin(to_end)) if to_end.size else -1
    if j >= 0 and to_end[j] < from_start[i]:
        return float(begin[ok][j])
    return float(starts[i])


def _arrival_times(
    shape: TrafficShape, n: int, rate: float, arrival: Arrival, rng: np.random.Generator,
    busiest: bool = False,
) -> np.ndarray:
    if arrival == "recorded":
        a = shape.arrivals
        if a is None or not a.rate_profile or shape.rate_rps <= 0:
            raise TrafficError(
                f"shape {shape.name!r} has no recorded arrival profile; use arrival 'gamma' "
                "or 'poisson' with a rate, or a closed loop"
            )
        prof = np.asarray(a.rate_profile, dtype=np.float64)
        cum = np.concatenate(([0.0], np.cumsum(prof * a.window_s)))
        total = cum[-1]
        period = prof.shape[0] * a.window_s

        def profile_time(lam: np.ndarray) -> np.ndarray:
            cycles = np.floor(lam / total)
            rem = lam - cycles * total
            idx = np.clip(np.searchsorted(cum, rem, side="right") - 1, 0, prof.shape[0] - 1)
            return (cycles * period + a.window_s * idx
                    + (rem - cum[idx]) / np.maximum(prof[idx], 1e-12))

        # unit-rate Poisson in "expected count" time, mapped through the recorded profile,
        # from the busiest stretch that holds the n arrivals when asked (busiest_stretch)
        lam0 = busiest_stretch(a.rate_profile, a.window_s, float(n)) if busiest else 0.0
        lam = lam0 + np.concatenate(([0.0], np.cumsum(rng.exponential(1.0, size=n - 1))))
        t = profile_time(lam) - profile_time(np.array([lam0]))[0]
        return t * (shape.rate_rps / rate)
    if arrival == "gamma":
        cv = _burstiness_cv(shape)
        if cv <= 1e-6:
            gaps = np.full(n - 1, 1.0 / rate)
        else:
            k = 1.0 / (cv * cv)
            gaps = rng.gamma(k, 1.0 / (k * rate), size=n - 1)
    else:
        gaps = rng.exponential(1.0 / rate, size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise TrafficError(f"{name} must be > 0 (got {value})")


def _rngs(seed: int, token_seed: int | None) -> list[np.random.Generator]:
    """Lengths, prefix sharing, token ids, arrivals: one generator each from ``seed``; the
    token ids from ``token_seed`` instead when given (the same traffic in other words)."""
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)]
    if token_seed is not None:
        if token_seed < 0:
            raise TrafficError(f"token_seed must be >= 0 (got {token_seed})")
        rngs[2] = np.random.default_rng([seed, 0x70C5EED, token_seed])
    return rngs


def jitter_lengths(lengths: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """``lengths`` each times a factor uniform in ``[1 - fraction, 1 + fraction]``, rounded,
    at least 1: the mean stays (up to rounding), the order of the draws is the seed's own."""
    rng = np.random.default_rng([seed, 0x0717E7])
    factor = rng.uniform(1.0 - fraction, 1.0 + fraction, size=lengths.shape[0])
    return np.maximum(1, np.rint(lengths * factor)).astype(lengths.dtype)


def _fitted(inp: np.ndarray, out: np.ndarray, *, seed: int, jitter: float, closed: bool,
            max_output_tokens: int | None,
            max_total_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The drawn lengths with the output jitter (closed loop only), then the caps:
    ``max_output_tokens`` again (a jittered length may pass it) and the server's context."""
    if not 0.0 <= jitter < 1.0:
        raise TrafficError(f"output_jitter must be in [0, 1) (got {jitter})")
    if closed and jitter > 0:
        out = jitter_lengths(out, jitter, seed)
        if max_output_tokens is not None:
            out = np.minimum(out, max_output_tokens)
    if max_total_tokens is not None:
        if max_total_tokens < 2:
            raise TrafficError(f"max_total_tokens must be >= 2 (got {max_total_tokens})")
        out = np.minimum(out, max_total_tokens - 1)
        inp = np.minimum(inp, max_total_tokens - out)
    return inp, out


def build_schedule(
    shape: TrafficShape,
    *,
    vocab_size: int | None = None,
    token_ids: Sequence[int] | None = None,
    seed: int = 0,
    mode: str | None = None,
    concurrency: int | None = None,
    num_requests: int | None = None,
    time_scale: float | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    max_total_tokens: int | None = None,
    token_offset: int = 4,
    rate_rps: float | None = None,
    arrival: str | None = None,
    token_seed: int | None = None,
    output_jitter: float = 0.0,
    busiest: bool = False,
) -> Schedule:
    """A deterministic request schedule for ``shape`` (same arguments, same schedule).

    Unset options come from ``shape.load``. Token ids lie in ``[token_offset, vocab_size)``,
    or are drawn from ``token_ids`` when given (the model's one-token words, see
    :mod:`autotune.load`: the same draws, mapped through that table).
    ``max_input_tokens``/``max_output_tokens`` clip the drawn lengths; ``max_total_tokens``
    (a server's context) clips each request's output to at most ``max_total_tokens - 1``,
    then its prompt so that prompt + output fit (see :func:`context_overflow`). Open loop:
    ``rate_rps`` (default the load's, else the recorded rate) divided by ``time_scale`` is
    the mean rate; ``arrival`` is "recorded" (the recorded rate profile, the default when
    the shape has one), "gamma" (burstiness-matched) or "poisson". ``token_seed`` draws the
    prompts' token ids (shared prefixes' content included) from its own seed while
    ``seed`` keeps the lengths, the prefix-sharing structure and the arrivals: the same
    traffic in other words, so that a prefix cache holds nothing of an earlier replay
    (a capacity search's load levels, :mod:`autotune.trial`). ``output_jitter`` (closed
    loop only): each request's output length times a factor drawn uniformly from
    ``[1 - j, 1 + j]`` (its own generator: every other draw stays the same), so that
    streams of equal lengths cannot lock into step with one another
    (docs/measurement.md, section 4). ``busiest`` (recorded arrivals only): the arrivals
    start where the recording's busiest stretch that holds the ``n`` requests begins
    (:func:`busiest_stretch`), not at the recording's start: a capacity level's traffic.
    """
    load = shape.load
    mode = mode or load.mode
    if mode not in ("open", "closed"):
        raise TrafficError(f"replay mode {mode!r} is unknown; use 'open' or 'closed'")
    n = num_requests if num_requests is not None else load.requests
    scale = time_scale if time_scale is not None else load.time_scale
    if n < 1:
        raise TrafficError(f"num_requests must be >= 1 (got {n})")
    table, token_offset, vocab_size = _token_range(token_ids, vocab_size, token_offset)
    for label, v in (
        ("max_input_tokens", max_input_tokens),
        ("max_output_tokens", max_output_tokens),
        ("max_total_tokens", max_total_tokens),
        ("time_scale", scale),
        ("rate_rps", rate_rps),
        ("concurrency", concurrency),
    ):
        _positive(label, v)
    rng_len, rng_prefix, rng_tok, rng_arr = _rngs(seed, token_seed)
    inp, out = _lengths(shape, n, rng_len, max_input_tokens, max_output_tokens)
    inp, out = _fitted(inp, out, seed=seed, jitter=output_jitter, closed=mode == "closed",
                       max_output_tokens=max_output_tokens, max_total_tokens=max_total_tokens)
    prompts = _prompts(shape, inp, rng_prefix, rng_tok, token_offset, vocab_size, table)

    if mode == "closed":
        return _closed_schedule(shape, prompts, out, concurrency=concurrency, seed=seed)
    times = _open_times(shape, n, rng_arr, rate_rps=rate_rps, arrival=arrival, scale=scale,
                        busiest=busiest)
    reqs = tuple(
        RequestSpec(
            index=i,
            prompt_token_ids=prompts[i],
            max_tokens=int(out[i]),
            send_at_s=round(float(times[i]), 6),
        )
        for i in range(times.shape[0])
    )
    cap = concurrency or load.concurrency
    return Schedule(mode="open", requests=reqs, concurrency=cap, seed=seed)


def _token_range(token_ids: Sequence[int] | None, vocab_size: int | None, token_offset: int
                 ) -> tuple[np.ndarray | None, int, int]:
    """Where prompt ids are drawn from: ``[token_offset, vocab_size)``, or positions in
    the ``token_ids`` table (returned with offset 0 and its length)."""
    table: np.ndarray | None = None
    if token_ids is not None:
        table = np.asarray(token_ids, dtype=np.int64)
        if table.ndim != 1 or table.shape[0] < 2:
            raise TrafficError(f"token_ids has {table.size} ids; prompts need at least 2")
        token_offset, vocab_size = 0, int(table.shape[0])
    if vocab_size is None:
        raise TrafficError("build_schedule needs vocab_size or token_ids to draw prompt ids")
    if token_offset < 0 or vocab_size - token_offset < 2:
        raise TrafficError(
            f"vocab_size {vocab_size} leaves no room for token ids >= token_offset "
            f"{token_offset}; use the model's real vocabulary size"
        )
    return table, token_offset, vocab_size


def _closed_schedule(shape: TrafficShape, prompts: Sequence[tuple[int, ...]], out: np.ndarray,
                     *, concurrency: int | None, seed: int) -> Schedule:
    """A closed loop: the requests in order, and its streams (asked, the load's, else the
    recorded mean concurrency)."""
    streams = concurrency or shape.load.concurrency
    if streams is None and shape.concurrency is not None:
        streams = max(1, round(shape.concurrency.mean))
    if streams is None:
        raise TrafficError(
            f"a closed-loop replay of shape {shape.name!r} needs a concurrency (streams)"
        )
    reqs = tuple(
        RequestSpec(index=i, prompt_token_ids=prompts[i], max_tokens=int(out[i]))
        for i in range(out.shape[0])
    )
    return Schedule(mode="closed", requests=reqs, concurrency=int(streams), seed=seed)


def _open_times(shape: TrafficShape, n: int, rng: np.random.Generator, *,
                rate_rps: float | None, arrival: str | None, scale: float,
                busiest: bool = False) -> np.ndarray:
    """An open loop's send times: ``n`` arrivals of the process ``arrival`` at ``rate_rps``
    (else the load's, else the recorded rate) stretched by ``scale``, cut at the load's
    ``duration_s``."""
    load = shape.load
    rate = rate_rps or load.rate_rps or shape.rate_rps
    if not rate or rate <= 0:
        raise TrafficError(
            f"shape {shape.name!r} has no recorded arrival rate (a synthetic shape); give an "
            "open-loop rate (rate_rps) or replay it closed loop"
        )
    has_profile = shape.arrivals is not None and bool(shape.arrivals.rate_profile)
    kind = arrival or ("recorded" if has_profile and shape.rate_rps > 0 else "gamma")
    if kind not in ARRIVALS:
        raise TrafficError(f"arrival process {kind!r} is unknown; use one of {', '.join(ARRIVALS)}")
    times = _arrival_times(shape, n, float(rate), kind, rng,  # type: ignore[arg-type]
                           busiest) * scale
    keep = n
    if load.duration_s is not None:
        keep = max(1, int(np.searchsorted(times, load.duration_s, side="right")))
        if keep < n:
            logger.info(
                "open-loop schedule capped at %.1f s: %d of %d requests", load.duration_s, keep, n
            )
    return times[:keep]


def context_overflow(
    shape: TrafficShape,
    *,
    context: int,
    seed: int = 0,
    num_requests: int | None = None,
) -> tuple[int, int, float]:
    """How many of the ``num_requests`` requests a replay draws (same seed, same draws as
    :func:`build_schedule`) have prompt + output beyond ``context`` tokens: (over, total,
    the largest prompt + output drawn). Pure and cheap: lengths only, no prompts."""
    n = num_requests if num_requests is not None else shape.load.requests
    if n < 1:
        raise TrafficError(f"num_requests must be >= 1 (got {n})")
    rng_len = np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[0])
    inp, out = _lengths(shape, n, rng_len, None, None)
    total = inp + out
    return int((total > context).sum()), n, float(total.max())


def ideal_prefix_hit_fraction(schedule: Schedule, *, block_tokens: int = 16) -> float:
    """Share of prompt tokens a perfect prefix cache with ``block_tokens`` blocks would serve
    when the requests arrive in order (what vLLM's prefix caching could reuse, at best)."""
    seen: set[bytes] = set()
    hits = 0
    total = 0
    for req in schedule.requests:
        ids = np.asarray(req.prompt_token_ids, dtype=np.int64)
        total += ids.shape[0]
        h = hashlib.blake2b(digest_size=16)
        leading = True
        for start in range(0, ids.shape[0] - block_tokens + 1, block_tokens):
            h.update(ids[start : start + block_tokens].tobytes())
            key = h.digest()
            if leading and key in seen:
                hits += block_tokens
            else:
                leading = False
                seen.add(key)
    return hits / total if total else 0.0
