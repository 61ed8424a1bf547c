"""Session-causal replay: conversations and agent sessions sent turn by turn.

A :class:`SessionSchedule` holds sessions drawn from a shape's ``sessions`` section
(:func:`session_schedule`, pure and seeded): each session's turns, with the new tokens each
turn adds, its output length and the think time before it. :class:`SessionLoop` (a driver
of :mod:`autotune.load._modes`) sends them causally: new sessions arrive open loop at the
shape's session rate (or N sessions run at once, closed loop); turn k+1 is sent its think
time after turn k's answer came back, with turn k's prompt + the token ids the server
returned for it + the turn's new tokens, so that a server's prefix cache can hit as it
does in production. Completions API only (token-id prompts; the server returns the
generated ids with vLLM's ``return_token_ids``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np

from autotune.errors import TrafficError
from autotune.traffic import RequestSpec

if TYPE_CHECKING:
    from autotune.load._records import RequestRecord
    from autotune.load._runner import _Runner
    from autotune.traffic import LengthDist, SessionStats, TrafficShape

__all__ = ["Session", "SessionLoop", "SessionSchedule", "Turn", "next_send_at",
           "session_horizon", "session_schedule", "steady_sessions"]

logger = logging.getLogger(__name__)

Basis = Literal["answer", "arrival"]


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn: the tokens it adds (the first turn: its whole prompt), the output length
    to force, and the think time before it (0 for a first turn)."""

    new_token_ids: tuple[int, ...]
    max_tokens: int
    think_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Session:
    """One session: its turns in order, and (open loop) when its first turn is sent.
    A session already mid-conversation when its replay starts (:func:`steady_sessions`)
    carries the conversation so far in ``context`` (its earlier prompts' tokens and
    answers, which its first turn here extends), ``first_turn`` (the number of its first
    turn here) and ``context_at_s`` (when its last earlier turn was sent, in the replay's
    time: negative)."""

    index: int
    turns: tuple[Turn, ...]
    start_s: float | None = None
    context: tuple[int, ...] = ()
    first_turn: int = 0
    context_at_s: float | None = None


@dataclass(frozen=True)
class SessionSchedule:
    """What a session replay sends. Open loop: each session starts at ``start_s``;
    closed loop: ``concurrency`` sessions run at once, a finished one replaced by the next.
    ``think_basis``: a turn's think time counts from its parent's answer (``answer``) or
    from its parent's send (``arrival``; never before the answer came back).
    ``max_total_tokens``: a session ends before a turn whose prompt + output would exceed
    it (the server's context). ``duration_s``: no sends after this many seconds."""

    sessions: tuple[Session, ...]
    mode: Literal["open", "closed"] = "open"
    concurrency: int | None = None
    think_basis: Basis = "answer"
    max_total_tokens: int | None = None
    duration_s: float | None = None
    seed: int = 0

    @property
    def requests(self) -> tuple[RequestSpec, ...]:
        """Every turn as a request of its own new tokens (what progress counts to)."""
        turns = (t for s in self.sessions for t in s.turns)
        return tuple(RequestSpec(index=i, prompt_token_ids=t.new_token_ids,
                                 max_tokens=t.max_tokens) for i, t in enumerate(turns))

    def turns(self) -> int:
        """Turns over every session."""
        return sum(len(s.turns) for s in self.sessions)

    def within_context(self) -> SessionSchedule:
        """The schedule without the turns its replay would not send for the context: a
        session ends before the turn whose prompt (every earlier prompt's new tokens and
        answer, answers as long as asked: the replay ignores EOS) plus its output would
        exceed ``max_total_tokens``; a session whose first turn does not fit is dropped.
        What a capacity level offers is then what it sends (unchanged without a limit)."""
        limit = self.max_total_tokens
        if limit is None:
            return self
        kept: list[Session] = []
        for sess in self.sessions:
            prompt, n = len(sess.context), 0
            for turn in sess.turns:
                prompt += len(turn.new_token_ids)
                if prompt + turn.max_tokens > limit:
                    break
                prompt += turn.max_tokens
                n += 1
            if n:
                kept.append(sess if n == len(sess.turns) else replace(sess,
                                                                      turns=sess.turns[:n]))
        return replace(self, sessions=tuple(kept))

    def context_primer(self, *, concurrency: int = 8) -> SessionSchedule | None:
        """What fills the server's prefix cache before a replay of sessions already
        mid-conversation (:func:`steady_sessions`): each such session's conversation so
        far as a prompt with a 1-token answer, in the order the sessions last spoke (the
        longest idle first, so a least-recently-used cache holds them in production's
        order), ``concurrency`` at once. None when no session has a context."""
        ctx = sorted((s for s in self.sessions if s.context),
                     key=lambda s: s.context_at_s if s.context_at_s is not None else 0.0)
        if not ctx:
            return None
        return SessionSchedule(
            sessions=tuple(Session(index=i, turns=(Turn(new_token_ids=s.context,
                                                        max_tokens=1),))
                           for i, s in enumerate(ctx)),
            mode="closed", concurrency=concurrency, seed=self.seed)


def next_send_at(basis: Basis, prev_send_s: float, prev_end_s: float, think_s: float) -> float:
    """When the next turn is sent (seconds of run time): its think time after the previous
    answer (``answer``), or after the previous send but never before the answer
    (``arrival``: the recorded gap then includes the answer's own time)."""
    if basis == "answer":
        return prev_end_s + think_s
    return max(prev_end_s, prev_send_s + think_s)


def _draw(dist: LengthDist, u: np.ndarray) -> np.ndarray:
    grid = np.arange(len(dist.quantiles), dtype=np.float64)
    return np.interp(u * (len(dist.quantiles) - 1), grid,
                     np.asarray(dist.quantiles, dtype=np.float64))


def _tokens(dist: LengthDist, n: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """``n`` token counts from ``dist`` times ``scale``, at least 1."""
    return np.maximum(1, np.rint(_draw(dist, rng.random(n)) * scale)).astype(np.int64)


def session_schedule(
    shape: TrafficShape,
    *,
    token_ids: Sequence[int],
    seed: int = 0,
    num_sessions: int | None = None,
    mode: Literal["open", "closed"] = "open",
    concurrency: int | None = None,
    rate_sps: float | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_total_tokens: int | None = None,
    duration_s: float | None = None,
    token_seed: int | None = None,
) -> SessionSchedule:
    """Sessions drawn from ``shape.sessions`` (deterministic for the same arguments).

    Per session: its turns (the shape's turns per session), its first prompt
    (``first_turn_tokens``), each later turn's new tokens (``new_tokens``; else
    ``context_growth`` less the drawn output; else the shape's prompt lengths), each
    turn's output (the shape's output lengths) and think time (``think_time_s``, else 0).
    Token counts are multiplied by ``length_scale`` (a small model's context), times by
    ``time_scale``. Open loop: sessions start as a Poisson process at ``rate_sps`` (else
    the recorded session rate); closed loop: ``concurrency`` sessions at once.
    ``num_sessions`` defaults to the shape's ``load.requests`` over the mean turns.
    Token ids are drawn from ``token_ids`` (the model's one-token words,
    :mod:`autotune.load._prompts`), from ``token_seed`` when given (other words, the
    same traffic)."""
    s = shape.sessions
    if s is None:
        raise TrafficError(
            f"shape {shape.name!r} has no sessions section, so it cannot be replayed turn by "
            "turn; fit it from a trace that links turns (session_id, parent_chat_id or "
            "hash_ids), or replay it as independent requests")
    for label, v in (("time_scale", time_scale), ("length_scale", length_scale)):
        if not v > 0:
            raise TrafficError(f"{label} must be > 0 (got {v})")
    table = np.asarray(token_ids, dtype=np.int64)
    if table.ndim != 1 or table.shape[0] < 2:
        raise TrafficError(f"token_ids has {table.size} ids; prompts need at least 2")
    n = num_sessions or max(1, round(shape.load.requests / max(1.0, s.turns.mean)))
    rng = np.random.default_rng([seed, 0x5E55])
    tok = np.random.default_rng([seed, 0x70C5, token_seed if token_seed is not None else 0])
    turns = np.clip(np.rint(_draw(s.turns, rng.random(n))), 1, max(1.0, s.turns.max))
    share = _Sharing.draw(s, n, np.random.default_rng([seed, 0x5A4E]),
                          (seed, token_seed if token_seed is not None else 0))
    sessions = tuple(
        Session(index=i, turns=_session_turns(shape, s, int(turns[i]), rng, tok, table,
                                              length_scale, time_scale, (share, i)))
        for i in range(n))
    if mode == "open":
        rate = rate_sps or s.rate_sps
        if not rate or rate <= 0:
            raise TrafficError(f"shape {shape.name!r} has no session rate; give rate_sps or "
                               "replay its sessions closed loop (a concurrency)")
        gaps = rng.exponential(time_scale / rate, size=n - 1)
        starts = np.concatenate(([0.0], np.cumsum(gaps)))
        sessions = tuple(replace(x, start_s=round(float(t), 6))
                         for x, t in zip(sessions, starts, strict=True))
    elif concurrency is None or concurrency < 1:
        raise TrafficError(f"a closed-loop session replay needs concurrency >= 1 "
                           f"(got {concurrency})")
    return SessionSchedule(sessions=sessions, mode=mode, concurrency=concurrency,
                           think_basis=s.think_time_basis, max_total_tokens=max_total_tokens,
                           duration_s=duration_s, seed=seed)


@dataclass(frozen=True)
class _Sharing:
    """Which sessions start with a prefix shared across sessions (``shared_prefix`` of the
    shape's sessions: a system prompt, a document), and how much of their first prompt it
    is: a share ``sharing_request_fraction`` of the sessions joins one of
    ``n / mean_group_size`` groups and takes the first ``ratio`` x its first prompt
    (``ratio`` drawn from ``shared_prefix_ratio``) from its group's tokens."""

    group: np.ndarray  # per session: its group, -1 for none
    ratio: np.ndarray
    seed: tuple[int, ...]

    @classmethod
    def draw(cls, s: SessionStats, n: int, rng: np.random.Generator,
             seed: tuple[int, ...]) -> _Sharing:
        p = s.shared_prefix
        group = np.full(n, -1, dtype=np.int64)
        ratio = np.zeros(n)
        if p is None or p.shared_prefix_ratio is None or p.sharing_request_fraction <= 0:
            return cls(group, ratio, seed)
        members = np.flatnonzero(rng.random(n) < p.sharing_request_fraction)
        groups = max(1, round(members.shape[0] / max(1.0, p.mean_group_size)))
        group[members] = rng.integers(0, groups, size=members.shape[0])
        grid = np.arange(len(p.shared_prefix_ratio), dtype=np.float64)
        ratio[members] = np.interp(rng.random(members.shape[0]) * (grid.shape[0] - 1), grid,
                                   np.asarray(p.shared_prefix_ratio, dtype=np.float64))
        return cls(group, ratio, seed)

    def apply(self, i: int, first: np.ndarray, table: np.ndarray) -> np.ndarray:
        """Session ``i``'s first prompt (token ids) with its group's prefix at its head:
        the group's tokens are the same for every session of the group (a seeded stream,
        of which each takes as much as it shares)."""
        g = int(self.group[i]) if i < self.group.shape[0] else -1
        k = min(first.shape[0], round(float(self.ratio[i]) * first.shape[0])) if g >= 0 else 0
        if k <= 0:
            return first
        head = table[np.random.default_rng([*self.seed, 0x5A4E, g]).integers(
            0, table.shape[0], size=k)]
        return np.concatenate((head, first[k:]))


#: the furthest back a steady state's sessions may have started (seconds)
HORIZON_MAX_S = 4 * 3600.0
#: sessions drawn at most to find a steady state's population (the window keeps fewer)
MAX_DRAWN = 500_000


def session_horizon(s: SessionStats) -> float:
    """How far back a session still open now may have started: the longest recorded
    session span (else the longest think time x the most turns), at most
    ``HORIZON_MAX_S``; 0 without think times."""
    if s.session_span_s is not None:
        span = s.session_span_s.max
    elif s.think_time_s is not None:
        span = s.think_time_s.max * max(0.0, s.turns.max - 1)
    else:
        span = 0.0
    return float(min(HORIZON_MAX_S, max(0.0, span)))


def steady_sessions(
    shape: TrafficShape,
    *,
    token_ids: Sequence[int],
    rate_sps: float,
    window_s: float,
    seed: int = 0,
    token_seed: int | None = None,
    max_total_tokens: int | None = None,
    max_sessions: int = 5000,
) -> SessionSchedule:
    """The turns a server receives in ``window_s`` seconds of the steady state at
    ``rate_sps`` new sessions a second (deterministic for the same arguments): sessions
    start as a Poisson process from :func:`session_horizon` before the window to its end,
    each with turns, lengths and think times drawn as :func:`session_schedule` draws them
    and its turns at their recorded gaps; the turns that fall in the window are sent.
    A session that started before the window begins there mid-conversation: its first
    turn here is sent when it falls due, and extends ``context`` (the earlier turns'
    prompts and answers, answers of the drawn length in words of the table, as the
    server never generated them; :meth:`SessionSchedule.context_primer` puts them into
    its cache first). New sessions start in the window at ``rate_sps``; turns due after
    the window are not sent. A long think time thus costs no wall time: the window is
    the level, whatever the think times."""
    s = shape.sessions
    if s is None:
        raise TrafficError(f"shape {shape.name!r} has no sessions section to replay")
    if not (rate_sps > 0 and window_s > 0):
        raise TrafficError(f"rate_sps ({rate_sps}) and window_s ({window_s}) must be > 0")
    table = np.asarray(token_ids, dtype=np.int64)
    if table.ndim != 1 or table.shape[0] < 2:
        raise TrafficError(f"token_ids has {table.size} ids; prompts need at least 2")
    rng = np.random.default_rng([seed, 0x57EA])
    horizon = session_horizon(s)
    n = int(min(MAX_DRAWN, rng.poisson(rate_sps * (horizon + window_s))))
    if n == 0:  # no session in the window: nothing to send
        return SessionSchedule(sessions=(), mode="open", think_basis=s.think_time_basis,
                               max_total_tokens=max_total_tokens, seed=seed)
    starts = np.sort(rng.uniform(-horizon, window_s, n))
    k = np.clip(np.rint(_draw(s.turns, rng.random(n))), 1, max(1.0, s.turns.max)
                ).astype(np.int64)
    first = np.concatenate(([0], np.cumsum(k)[:-1]))
    think = (_draw(s.think_time_s, rng.random(int(k.sum()))) if s.think_time_s is not None
             else np.zeros(int(k.sum())))
    think[first] = 0.0
    cum = np.cumsum(think)
    at = np.repeat(starts, k) + cum - np.repeat(cum[first], k)  # each turn's due time
    due = (at >= 0) & (at < window_s)
    kept = np.flatnonzero(np.add.reduceat(due, first) > 0)[:max_sessions]
    tok = np.random.default_rng([seed, 0x70C5, token_seed if token_seed is not None else 0])
    share = _Sharing.draw(s, n, np.random.default_rng([seed, 0x5A4E]),
                          (seed, token_seed if token_seed is not None else 0))
    sessions = tuple(_in_window(shape, s, i, at[first[j]:first[j] + k[j]], think[
        first[j]:first[j] + k[j]], due[first[j]:first[j] + k[j]],
        np.random.default_rng([seed, 0x7E5, int(j)]), tok, table, (share, int(j)))
        for i, j in enumerate(kept))
    return SessionSchedule(sessions=sessions, mode="open", think_basis=s.think_time_basis,
                           max_total_tokens=max_total_tokens, seed=seed)


def _in_window(shape: TrafficShape, s: SessionStats, index: int, at: np.ndarray,
               think: np.ndarray, due: np.ndarray, rng: np.random.Generator,
               tok: np.random.Generator, table: np.ndarray,
               share: tuple[_Sharing, int]) -> Session:
    """One session of :func:`steady_sessions`: its turns due in the window (``due``) and,
    before them, its conversation so far as ``context``; its first prompt starts with its
    group's prefix when ``share`` gives it one."""
    sizes, out = _turn_tokens(shape, s, at.shape[0], rng, 1.0)
    j0, j1 = int(np.argmax(due)), int(np.flatnonzero(due)[-1])

    def words(j: int, n: int) -> np.ndarray:
        ids = table[tok.integers(0, table.shape[0], size=n)]
        return share[0].apply(share[1], ids, table) if j == 0 else ids

    context: list[int] = []
    for j in range(j0):  # the earlier prompts' new tokens and answers
        context += [*words(j, int(sizes[j])).tolist(), *table[tok.integers(
            0, table.shape[0], size=int(out[j]))].tolist()]
    turns = tuple(Turn(new_token_ids=tuple(words(j, int(sizes[j])).tolist()),
                       max_tokens=int(out[j]), think_s=0.0 if j == j0 else float(think[j]))
                  for j in range(j0, j1 + 1))
    return Session(index=index, turns=turns, start_s=round(float(at[j0]), 6),
                   context=tuple(context), first_turn=j0,
                   context_at_s=round(float(at[j0 - 1]), 6) if j0 else None)


def _turn_tokens(shape: TrafficShape, s: SessionStats, k: int, rng: np.random.Generator,
                 length_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The new tokens and the output length of a session's ``k`` turns (see
    :func:`session_schedule`); ``s``: the shape's sessions section."""
    out = _tokens(shape.output_tokens, k, rng, length_scale)
    sizes = np.empty(k, dtype=np.int64)
    sizes[0] = _tokens(s.first_turn_tokens, 1, rng, length_scale)[0]
    if k > 1:
        if s.new_tokens is not None:
            sizes[1:] = _tokens(s.new_tokens, k - 1, rng, length_scale)
        elif s.context_growth is not None:
            grown = _tokens(s.context_growth, k - 1, rng, length_scale)
            sizes[1:] = np.maximum(1, grown - out[:-1])
        else:
            sizes[1:] = _tokens(shape.input_tokens, k - 1, rng, length_scale)
    return sizes, out


def _session_turns(shape: TrafficShape, s: SessionStats, k: int, rng: np.random.Generator,
                   tok: np.random.Generator, table: np.ndarray, length_scale: float,
                   time_scale: float, share: tuple[_Sharing, int] | None = None
                   ) -> tuple[Turn, ...]:
    """One session's ``k`` turns (see :func:`session_schedule`); ``s``: the shape's
    sessions section; ``share``: the sharing across sessions and this session's number."""
    sizes, out = _turn_tokens(shape, s, k, rng, length_scale)
    think = (_draw(s.think_time_s, rng.random(k)) * time_scale if s.think_time_s is not None
             else np.zeros(k))
    ids = table[tok.integers(0, table.shape[0], size=int(sizes.sum()))]
    if share is not None:
        ids[:sizes[0]] = share[0].apply(share[1], ids[:sizes[0]], table)
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    return tuple(Turn(new_token_ids=tuple(ids[bounds[j]:bounds[j + 1]].tolist()),
                      max_tokens=int(out[j]), think_s=0.0 if j == 0 else float(think[j]))
                 for j in range(k))


@dataclass
class _Counts:
    """What a session replay tells after its run (logged)."""

    next_index: Iterator[int]
    cut_by_context: int = 0
    no_ids: int = 0


@dataclass(frozen=True)
class SessionLoop:
    """The driver of a :class:`SessionSchedule` (:class:`autotune.load._modes.Driver`):
    sessions started open loop at their ``start_s`` or ``concurrency`` at once (closed
    loop), each sending its turns causally (module docstring). Records carry their
    ``session`` and ``turn``; a failed turn ends its session."""

    schedule: SessionSchedule

    @property
    def mode(self) -> Literal["open", "closed"]:
        return self.schedule.mode

    @property
    def concurrency(self) -> int | None:
        return self.schedule.concurrency

    @property
    def requests(self) -> Sequence[RequestSpec]:
        return self.schedule.requests

    def connections(self) -> int:
        if self.schedule.mode == "closed" and self.schedule.concurrency:
            return self.schedule.concurrency
        return max(1, len(self.schedule.sessions))

    async def drive(self, run: _Runner, out: dict[int, RequestRecord]) -> None:
        counts = _Counts(itertools.count())
        sched = self.schedule
        async with asyncio.TaskGroup() as tg:
            if sched.mode == "closed":
                queue = iter(sched.sessions)

                async def slot() -> None:
                    for sess in queue:  # one iterator: each slot takes the next session
                        if self._stopped(run):
                            return
                        await self._session(run, sess, out, counts)

                for _ in range(sched.concurrency or 1):
                    tg.create_task(slot())
            else:
                for sess in sorted(sched.sessions, key=lambda x: x.start_s or 0.0):
                    delay = run.t0 + (sess.start_s or 0.0) - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if self._stopped(run):
                        break
                    tg.create_task(self._session(run, sess, out, counts))
        if counts.cut_by_context:
            logger.info("%d sessions ended early: their next turn would not fit the "
                        "context (%s tokens)", counts.cut_by_context, sched.max_total_tokens)
        if counts.no_ids:
            logger.warning("%d answers came without token ids (return_token_ids): their "
                           "next turns could not extend them", counts.no_ids)

    def _stopped(self, run: _Runner) -> bool:
        """No more sends: a hook stopped them, or the schedule's duration has passed."""
        if run.stopped_at is not None:
            return True
        cap = self.schedule.duration_s
        if cap is not None and run.now() >= cap:
            run.stopped_at = run.now()
            return True
        return False

    async def _session(self, run: _Runner, sess: Session, out: dict[int, RequestRecord],
                       counts: _Counts) -> None:
        """One session's turns, each after the previous answer and its think time."""
        prompt: list[int] = list(sess.context)  # the conversation so far, if any
        ids: list[int] = []
        limit = self.schedule.max_total_tokens
        prev: RequestRecord | None = None
        for k, turn in enumerate(sess.turns):
            if prev is not None:
                at = next_send_at(self.schedule.think_basis, prev.send_s,
                                  prev.end_s if prev.end_s is not None else run.now(),
                                  turn.think_s)
                delay = run.t0 + at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if self._stopped(run):
                return
            prompt = [*prompt, *ids, *turn.new_token_ids]
            if limit is not None and len(prompt) + turn.max_tokens > limit:
                counts.cut_by_context += 1
                return
            i = next(counts.next_index)
            ids = []
            spec = RequestSpec(index=i, prompt_token_ids=tuple(prompt),
                               max_tokens=turn.max_tokens)
            rec = replace(await run.request(spec, ids), session=sess.index,
                          turn=sess.first_turn + k)
            out[i] = rec
            if not rec.ok:
                return
            if not ids and rec.output_tokens > 0:
                counts.no_ids += 1
            prev = rec

