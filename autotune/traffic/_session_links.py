"""Which request is the next turn of which: session links from a trace's ``session_id``,
``parent_chat_id`` or ``hash_ids``, and the checks that refuse broken links."""

from __future__ import annotations

import numpy as np

from autotune.errors import TraceFormatError
from autotune.traffic._collect import (
    _MOONCAKE_BLOCK_TOKENS,
    _MULTI_TURN_BLOCK_TOKENS,
    _Extra,
    _TurnRaw,
)
from autotune.traffic._records import (
    FloatArray,
    IntArray,
    PrefixInfo,
    SessionLinks,
    prefix_from_blocks,
    prefix_from_ids,
    prefix_from_sessions,
)

__all__ = [
    "cross_session_prefix",
    "links_from_blocks",
    "links_from_session_ids",
    "prefix_and_sessions",
    "resolve_turns",
]

_MAX_CYCLE_SHOWN = 6


def links_from_session_ids(session: IntArray) -> SessionLinks:
    """Turns of one ``session`` (-1 = none) follow each other in the records' order."""
    n = int(session.shape[0])
    order = np.lexsort((np.arange(n), session))
    s = session[order]
    same = (s[1:] == s[:-1]) & (s[1:] >= 0)
    parent = np.full(n, -1, dtype=np.int64)
    parent[order[1:][same]] = order[:-1][same]
    return SessionLinks("session_id", parent)


def _common_lead(block_ids: IntArray, offsets: IntArray) -> list[int]:
    """Per request, how many of its leading blocks more than half of all requests hold (a
    system prompt every conversation starts with, not a conversation of its own)."""
    n = int(offsets.shape[0]) - 1
    uniq, counts = np.unique(block_ids, return_counts=True)
    common = set(uniq[counts * 2 > n].tolist())
    lead = []
    ids, off = block_ids.tolist(), offsets.tolist()
    for r in range(n):
        k = 0
        while off[r] + k < off[r + 1] and ids[off[r] + k] in common:
            k += 1
        lead.append(k)
    return lead


def links_from_blocks(
    block_ids: IntArray,
    offsets: IntArray,
    input_tokens: IntArray,
    order: IntArray,
    *,
    block_tokens: int,
) -> SessionLinks:
    """A request whose block list starts with all complete blocks of an earlier, shorter
    request (a proper prefix) is that request's next turn.

    Complete blocks: the earlier prompt's last block is usually partial, and its id differs
    from the full block the next turn holds there. The match must reach past the leading
    blocks most requests share (a system prompt). The longest match wins, then the latest
    request with it. ``order`` lists the raw rows by arrival; the links index it.
    """
    ids, off = block_ids.tolist(), offsets.tolist()
    rows, inp = order.tolist(), input_tokens.tolist()
    lead = _common_lead(block_ids, offsets)
    # (last complete block id, number of complete blocks) -> requests (arrival indices)
    seen: dict[tuple[int, int], list[int]] = {}
    parent = np.full(len(rows), -1, dtype=np.int64)
    for j, r in enumerate(rows):
        mine = ids[off[r] : off[r + 1]]
        for k in range(len(mine) - 1, lead[r], -1):
            found = next(
                (c for c in reversed(seen.get((mine[k - 1], k), ()))
                 if inp[rows[c]] < inp[r] and ids[off[rows[c]] : off[rows[c]] + k] == mine[:k]),
                -1,
            )
            if found >= 0:
                parent[j] = found
                break
        full = min(inp[r] // block_tokens, len(mine))
        if full > lead[r]:
            seen.setdefault((mine[full - 1], full), []).append(j)
    return SessionLinks("hash_ids", parent)


def _where(name: str, line: int) -> str:
    return f"traffic file {name} line {line}"


def _link_past_dropped(turns: _TurnRaw, code: int, row_of: dict[int, int]) -> int:
    """The code of the nearest kept turn up the chain (a failed turn is left out)."""
    hops: set[int] = set()
    while code >= 0 and code not in row_of and code in turns.dropped and code not in hops:
        hops.add(code)
        code = turns.dropped[code]
    return code


def resolve_turns(turns: _TurnRaw, ts: FloatArray, *, name: str, skip_bad: bool) -> IntArray:
    """Each kept row's parent row (-1 = first turn), in the reader's row order.

    Refuses a repeated ``chat_id``, a ``parent_chat_id`` no turn has (unless ``skip_bad``:
    then the turn starts a session), a cycle of parent links and a turn that arrives before
    its parent, each with :class:`TraceFormatError` naming the line.
    """
    chat, lines = turns.chat.tolist(), turns.lines.tolist()
    row_of: dict[int, int] = {}
    for i, c in enumerate(chat):
        if c in row_of:
            raise TraceFormatError(
                f"{_where(name, lines[i])}: 'chat_id' {turns.names[c]} is already the id of "
                f"line {lines[row_of[c]]}; every turn needs its own chat_id"
            )
        row_of[c] = i
    parent = np.full(len(chat), -1, dtype=np.int64)
    for i, code in enumerate(turns.parent.tolist()):
        code = _link_past_dropped(turns, code, row_of)
        if code < 0:
            continue
        if code in row_of:
            parent[i] = row_of[code]
        elif skip_bad:
            turns.cut_lines.append(lines[i])
        else:
            raise TraceFormatError(
                f"{_where(name, lines[i])}: 'parent_chat_id' is {turns.names[code]}, but no "
                "turn has that chat_id; add the missing turn, or give a session's first turn "
                "parent_chat_id -1 (or pass --skip-bad to start a session there)"
            )
    _refuse_cycles(parent, turns, chat, lines, name)
    has = np.flatnonzero(parent >= 0)
    early = has[ts[has] < ts[parent[has]]]
    if early.shape[0]:
        i = int(early[0])
        j = int(parent[i])
        raise TraceFormatError(
            f"{_where(name, lines[i])}: turn {turns.names[chat[i]]} arrives at {ts[i]:g} s, "
            f"before its parent {turns.names[chat[j]]} (line {lines[j]}) at {ts[j]:g} s, a "
            "negative think time; a turn is sent after its parent: fix its timestamp or "
            "its parent_chat_id"
        )
    return parent


def _refuse_cycles(
    parent: IntArray, turns: _TurnRaw, chat: list[int], lines: list[int], name: str
) -> None:
    state = np.zeros(parent.shape[0], dtype=np.int8)  # 0 new, 1 on the path, 2 done
    up = parent.tolist()
    for start in range(len(up)):
        path: list[int] = []
        j = start
        while j >= 0 and state[j] == 0:
            state[j] = 1
            path.append(j)
            j = up[j]
        if j >= 0 and state[j] == 1:
            loop = path[path.index(j):]
            ids = [turns.names[chat[k]] for k in loop[:_MAX_CYCLE_SHOWN]]
            shown = " -> ".join([*ids, ids[0] if len(loop) <= _MAX_CYCLE_SHOWN else "..."])
            raise TraceFormatError(
                f"{_where(name, lines[j])}: the parent links form a cycle (chat_id {shown} "
                "following each other's parent_chat_id); a session starts with a turn whose "
                "parent_chat_id is -1: fix the parent_chat_id"
            )
        state[path] = 2


def prefix_and_sessions(
    fmt: str,
    extra: _Extra,
    order: IntArray,
    raw: tuple[FloatArray, IntArray, IntArray],
    *,
    name: str,
    skip_bad: bool,
) -> tuple[PrefixInfo | None, SessionLinks | None]:
    """Prefix sharing and session links in arrival order (``order``: the raw rows sorted),
    from the reader's raw columns ``raw`` = (timestamps, input, output), in its row order."""
    ts, inp, out = raw
    links: SessionLinks | None = None
    prefix: PrefixInfo | None = None
    praw = extra.prefix
    if extra.turns is not None:
        up = resolve_turns(extra.turns, ts, name=name, skip_bad=skip_bad)
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0], dtype=np.int64)
        sorted_up = up[order]
        links = SessionLinks("parent_id", np.where(sorted_up >= 0, rank[sorted_up], -1))
    if praw is None:
        if links is not None:  # no blocks: a turn shares its parent's prompt and answer
            root, _ = links.tree()
            prefix = prefix_from_sessions(root, ts[order], inp[order], out[order])
        return prefix, links
    blocks = np.frombuffer(praw.blocks, dtype=np.int64)
    offsets = np.frombuffer(praw.offsets, dtype=np.int64)
    if fmt in ("mooncake", "multi_turn"):
        size = _MOONCAKE_BLOCK_TOKENS if fmt == "mooncake" else _MULTI_TURN_BLOCK_TOKENS
        prefix = prefix_from_blocks(blocks, offsets, inp, block_tokens=size).take(order)
        if links is None:
            links = links_from_blocks(blocks, offsets, inp, order, block_tokens=size)
        return prefix, links
    session = np.frombuffer(praw.session, dtype=np.int64)
    if praw.seen_prefix:
        prefix = prefix_from_ids(
            np.frombuffer(praw.prefix_id, dtype=np.int64),
            np.frombuffer(praw.prefix_tokens, dtype=np.int64),
            inp,
        ).take(order)
    else:
        prefix = prefix_from_sessions(session, ts, inp, out).take(order)
    if praw.seen_session:
        links = links_from_session_ids(session[order])
    return prefix, links


def cross_session_prefix(fmt: str, extra: _Extra, order: IntArray, inp: IntArray,
                         links: SessionLinks | None) -> PrefixInfo | None:
    """The prefixes sessions share with *other* sessions (a system prompt, a document),
    in arrival order (``order``: the raw rows sorted; ``inp``: the raw input column):
    the sharing of the sessions' first turns among themselves, from their hash blocks or
    prefix ids; 0 for every later turn (its reuse of its own session is the session's).
    None without session links or without blocks or prefix ids."""
    praw = extra.prefix
    if links is None or praw is None:
        return None
    roots = order[links.parent < 0]  # raw rows of the first turns
    n = order.shape[0]
    if fmt in ("mooncake", "multi_turn"):
        blocks = np.frombuffer(praw.blocks, dtype=np.int64)
        offsets = np.frombuffer(praw.offsets, dtype=np.int64)
        lengths = (offsets[1:] - offsets[:-1])[roots]
        sub_off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        sub = (np.concatenate([blocks[offsets[i]:offsets[i + 1]] for i in roots])
               if roots.shape[0] else np.empty(0, dtype=np.int64))
        size = _MOONCAKE_BLOCK_TOKENS if fmt == "mooncake" else _MULTI_TURN_BLOCK_TOKENS
        info = prefix_from_blocks(sub, sub_off, inp[roots], block_tokens=size)
    elif praw.seen_prefix:
        info = prefix_from_ids(np.frombuffer(praw.prefix_id, dtype=np.int64)[roots],
                               np.frombuffer(praw.prefix_tokens, dtype=np.int64)[roots],
                               inp[roots])
    else:
        return None
    shared = np.zeros(n, dtype=np.int64)
    hits = np.zeros(n, dtype=np.float64)
    group = np.full(n, -1, dtype=np.int64)
    first = np.flatnonzero(links.parent < 0)
    shared[first], hits[first], group[first] = info.shared_tokens, info.hit_tokens, info.group
    return PrefixInfo(info.source, shared, hits, group, info.block_tokens)
