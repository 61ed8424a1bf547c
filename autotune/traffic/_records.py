"""Parsed request records (numeric arrays only) and the prefix-sharing arithmetic on them."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "PrefixInfo",
    "SessionLinks",
    "SkippedLine",
    "TraceRecords",
    "prefix_from_blocks",
    "prefix_from_ids",
    "prefix_from_sessions",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
PrefixSource = Literal["hash_ids", "session", "prefix_id"]
SessionSource = Literal["session_id", "parent_id", "hash_ids"]


@dataclass(frozen=True, slots=True)
class SkippedLine:
    """One line left out by ``skip_bad`` (kept for the summary; only the first few are kept)."""

    line: int
    reason: str


@dataclass(frozen=True, slots=True)
class PrefixInfo:
    """Per-request prefix sharing, aligned with the records' arrays.

    ``shared_tokens[i]``: leading prompt tokens of request i that at least one other request
    has too. ``hit_tokens[i]``: its share of the tokens a perfect prefix cache would serve
    (each shared block seen c times counts (c-1)/c of its tokens to each holder, so the sum
    over requests is exactly the order-independent total of cache hits). ``group[i]``: key
    of the prefix family it belongs to (-1 = shares nothing).
    """

    source: PrefixSource
    shared_tokens: IntArray
    hit_tokens: FloatArray
    group: IntArray
    block_tokens: int | None = None

    def take(self, index: IntArray) -> PrefixInfo:
        """The same info reordered / filtered by ``index``."""
        return PrefixInfo(
            source=self.source,
            shared_tokens=self.shared_tokens[index],
            hit_tokens=self.hit_tokens[index],
            group=self.group[index],
            block_tokens=self.block_tokens,
        )


@dataclass(frozen=True, slots=True)
class SessionLinks:
    """Which request is the next turn of which, aligned with the records' arrays.

    ``parent[i]``: index of the turn request i follows (always an earlier or simultaneous
    arrival), -1 for a session's first turn. ``source``: how the links were found.
    """

    source: SessionSource
    parent: IntArray

    def take(self, index: IntArray) -> SessionLinks:
        """The links among the requests ``index`` picks, reindexed; a turn whose parent is
        left out starts a session."""
        pos = np.full(self.parent.shape[0], -1, dtype=np.int64)
        pos[index] = np.arange(index.shape[0], dtype=np.int64)
        up = self.parent[index]
        return SessionLinks(self.source, np.where(up >= 0, pos[up], -1))

    def tree(self) -> tuple[IntArray, IntArray]:
        """``(root, turn)``: per request, the index of its session's first turn and its turn
        number (1 = first turn)."""
        parent = self.parent
        has = parent >= 0
        # pointer jumping (list ranking): each pass doubles the distance followed; the links
        # are acyclic (the readers refuse a cycle)
        nxt = np.where(has, parent, np.arange(parent.shape[0], dtype=np.int64))
        dist = has.astype(np.int64)
        while True:
            jumped = nxt[nxt]
            if np.array_equal(jumped, nxt):
                return nxt, dist + 1
            dist = dist + dist[nxt]
            nxt = jumped


@dataclass(frozen=True, slots=True)
class TraceRecords:
    """Requests read from a trace, sorted by arrival; failed and bad rows already left out.

    ``timestamps_s`` are seconds from the first request. Token counts are int64 and >= 1.
    ``skipped`` counts bad lines left out by ``skip_bad``; ``failed`` counts failed or
    zero-token requests (valid lines, but no use for a traffic shape).
    """

    path: str
    format: str
    timestamps_s: FloatArray
    input_tokens: IntArray
    output_tokens: IntArray
    skipped: int = 0
    failed: int = 0
    skipped_examples: tuple[SkippedLine, ...] = ()
    prefix: PrefixInfo | None = None
    sessions: SessionLinks | None = None
    # the prefixes sessions share with other sessions (their first turns' sharing among
    # themselves; 0 on later turns): autotune.traffic._session_links.cross_session_prefix
    cross_prefix: PrefixInfo | None = None
    latencies_s: FloatArray | None = None
    start_epoch_s: float | None = None
    was_sorted: bool = True
    # lines of turns whose parent_chat_id no turn has: --skip-bad started a session at each,
    # cutting that link (a multi-turn trace; empty otherwise)
    links_cut: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.input_tokens.shape[0])


def _segment_ids(offsets: IntArray) -> IntArray:
    lengths = np.diff(offsets)
    return np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)


def prefix_from_blocks(
    block_ids: IntArray,
    offsets: IntArray,
    input_tokens: IntArray,
    *,
    block_tokens: int,
    chunk_blocks: int = 1 << 20,
) -> PrefixInfo:
    """Prefix sharing from per-request prefix-block ids (Mooncake ``hash_ids``).

    ``block_ids[offsets[i]:offsets[i+1]]`` are request i's block ids; equal ids mean equal
    prefixes (the ids hash the whole prefix up to that block). Order-independent. Memory:
    the ids, their sorted unique copy and counts, plus ``chunk_blocks``-sized temporaries.
    """
    n = int(input_tokens.shape[0])
    shared = np.zeros(n, dtype=np.int64)
    hits = np.zeros(n, dtype=np.float64)
    group = np.full(n, -1, dtype=np.int64)
    if block_ids.shape[0] == 0:
        return PrefixInfo("hash_ids", shared, hits, group, block_tokens)
    uniq, counts = np.unique(block_ids, return_counts=True)
    nblocks = np.diff(offsets)
    big = np.iinfo(np.int64).max
    first_unshared = np.full(n, big, dtype=np.int64)
    # whole requests per chunk, about chunk_blocks ids each
    bounds = np.searchsorted(offsets, np.arange(0, offsets[-1], chunk_blocks), side="right") - 1
    edges = [*np.unique(bounds).tolist(), n]
    for r0, r1 in pairwise(edges):
        lo, hi = int(offsets[r0]), int(offsets[r1])
        if hi == lo:
            continue
        seg = _segment_ids(offsets[r0 : r1 + 1] - lo) + r0
        pos = np.arange(lo, hi, dtype=np.int64) - offsets[seg]
        ids = block_ids[lo:hi]
        c = counts[np.searchsorted(uniq, ids)]
        # each block's tokens (the last one may be partial); (c-1)/c of a block shared by
        # c requests is a cache hit, whatever their order
        tok = np.clip(input_tokens[seg] - pos * block_tokens, 0, block_tokens)
        hits[r0:r1] += np.bincount(seg - r0, weights=tok * (c - 1) / c, minlength=r1 - r0)
        np.minimum.at(first_unshared, seg, np.where(c >= 2, big, pos))
    lead = np.minimum(first_unshared, nblocks)
    shared = np.minimum(lead * block_tokens, input_tokens).astype(np.int64)
    has = lead > 0
    group[has] = block_ids[offsets[:-1][has]]
    return PrefixInfo("hash_ids", shared, hits, group, block_tokens)


def prefix_from_sessions(
    session: IntArray, timestamps_s: FloatArray, input_tokens: IntArray, output_tokens: IntArray
) -> PrefixInfo:
    """Prefix sharing of multi-turn sessions: turn k's prompt starts with turn k-1's
    prompt and answer, so it shares ``min(input_k, input_{k-1} + output_{k-1})`` tokens.

    Turns are ordered by (time, input, output), which does not depend on the file's order.
    ``session < 0`` means no session.
    """
    n = int(input_tokens.shape[0])
    shared = np.zeros(n, dtype=np.int64)
    hits = np.zeros(n, dtype=np.float64)
    group = np.full(n, -1, dtype=np.int64)
    order = np.lexsort((output_tokens, input_tokens, timestamps_s, session))
    s = session[order]
    inp = input_tokens[order]
    out = output_tokens[order]
    same_as_prev = np.zeros(n, dtype=bool)
    same_as_prev[1:] = (s[1:] == s[:-1]) & (s[1:] >= 0)
    hit = np.zeros(n, dtype=np.int64)
    prev_ctx = np.zeros(n, dtype=np.int64)
    prev_ctx[1:] = inp[:-1] + out[:-1]
    hit[same_as_prev] = np.minimum(inp, prev_ctx)[same_as_prev]
    next_hit = np.zeros(n, dtype=np.int64)
    next_hit[:-1] = hit[1:]
    sh = np.maximum(hit, np.minimum(inp, next_hit))
    shared[order] = sh
    hits[order] = hit.astype(np.float64)
    grp = np.where(sh > 0, s, -1)
    group[order] = grp
    return PrefixInfo("session", shared, hits, group, None)


def prefix_from_ids(
    prefix_id: IntArray, prefix_tokens: IntArray, input_tokens: IntArray
) -> PrefixInfo:
    """Prefix sharing declared per request: same ``prefix_id`` = the first ``prefix_tokens``
    tokens are the same (e.g. a system prompt). ``prefix_id < 0`` means none."""
    n = int(input_tokens.shape[0])
    shared = np.zeros(n, dtype=np.int64)
    hits = np.zeros(n, dtype=np.float64)
    group = np.full(n, -1, dtype=np.int64)
    valid = prefix_id >= 0
    if not np.any(valid):
        return PrefixInfo("prefix_id", shared, hits, group, None)
    _, inverse, counts = np.unique(prefix_id[valid], return_inverse=True, return_counts=True)
    c = counts[inverse]
    sh = np.where(c >= 2, np.minimum(prefix_tokens[valid], input_tokens[valid]), 0)
    shared[valid] = sh
    hits[valid] = sh * (c - 1) / c
    group[valid] = np.where(sh > 0, prefix_id[valid], -1)
    return PrefixInfo("prefix_id", shared, hits, group, None)
