"""Exact replay of a hash-id trace (Mooncake style): every request's prompt is built from
its recorded prefix blocks, so a prefix cache sees exactly the recorded sharing.

Each hash id is one fixed block of token ids, the same wherever it occurs (drawn from the
id and a seed); a request's prompt is its blocks in order, cut or padded (with tokens of
its own) to its input length; requests are sent open loop at their recorded times. Blocks
of ``block_tokens`` tokens stand for the trace's blocks of ``trace_block_tokens`` (512 in
Mooncake's traces): every length is scaled by their ratio, so a trace of long prompts
replays on a small model with the same structure. What a fitted shape's replay is checked
against (docs/traffic.md, exact vs fitted replay).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autotune.errors import TrafficError
from autotune.traffic import RequestSpec, Schedule

__all__ = ["HashRequest", "block_token_ids", "exact_schedule", "read_hash_trace"]


@dataclass(frozen=True, slots=True)
class HashRequest:
    """One request of a hash-id trace: arrival (s from the trace's start), lengths, and
    the hash ids of its prefix blocks."""

    t_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_hash_trace(path: str | Path, *, limit: int | None = None) -> list[HashRequest]:
    """The requests of a Mooncake-style JSONL trace (``timestamp`` in ms, ``input_length``,
    ``output_length``, ``hash_ids``), in file order; the first ``limit`` when given. A bad
    line is a :class:`TrafficError` naming it."""
    out: list[HashRequest] = []
    with Path(path).open(encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                req = HashRequest(t_s=float(row["timestamp"]) / 1000.0,
                                  input_length=int(row["input_length"]),
                                  output_length=int(row["output_length"]),
                                  hash_ids=tuple(int(h) for h in row["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise TrafficError(f"{path} line {no}: not a hash-id trace request ({exc}); "
                                   "each line needs timestamp, input_length, output_length "
                                   "and hash_ids") from None
            if req.input_length < 1 or req.output_length < 0:
                raise TrafficError(f"{path} line {no}: input_length {req.input_length}, "
                                   f"output_length {req.output_length}; they must be >= 1 "
                                   "and >= 0")
            out.append(req)
    if not out:
        raise TrafficError(f"{path} holds no request")
    return out


def block_token_ids(hash_id: int, block_tokens: int, table: np.ndarray,
                    seed: int = 0) -> np.ndarray:
    """The token ids of one block: ``block_tokens`` ids from ``table``, the same for the
    same hash id and seed."""
    rng = np.random.default_rng([seed, 0xB10C, hash_id])
    return table[rng.integers(0, table.shape[0], size=block_tokens)]


def exact_schedule(
    requests: Sequence[HashRequest],
    *,
    token_ids: Sequence[int],
    block_tokens: int = 16,
    trace_block_tokens: int = 512,
    time_scale: float = 1.0,
    max_total_tokens: int | None = None,
    seed: int = 0,
) -> Schedule:
    """An open-loop schedule of ``requests`` with their recorded prefix blocks (module
    docstring): lengths times ``block_tokens / trace_block_tokens`` (at least 1 token;
    outputs too), send times from the first request's, times ``time_scale``.
    ``max_total_tokens`` clips an output to that less 1, then its prompt to fit."""
    if block_tokens < 1 or trace_block_tokens < 1:
        raise TrafficError(f"block sizes must be >= 1 (block_tokens {block_tokens}, "
                           f"trace_block_tokens {trace_block_tokens})")
    if not time_scale > 0:
        raise TrafficError(f"time_scale must be > 0 (got {time_scale})")
    if not requests:
        raise TrafficError("no request to replay")
    table = np.asarray(token_ids, dtype=np.int64)
    if table.ndim != 1 or table.shape[0] < 2:
        raise TrafficError(f"token_ids has {table.size} ids; prompts need at least 2")
    ratio = block_tokens / trace_block_tokens
    t0 = min(r.t_s for r in requests)
    blocks: dict[int, np.ndarray] = {}
    specs = []
    for i, req in enumerate(requests):
        n_in = max(1, round(req.input_length * ratio))
        n_out = max(1, round(req.output_length * ratio))
        if max_total_tokens is not None:
            n_out = min(n_out, max_total_tokens - 1)
            n_in = min(n_in, max_total_tokens - n_out)
        parts = []
        for h in req.hash_ids:
            if h not in blocks:
                blocks[h] = block_token_ids(h, block_tokens, table, seed)
            parts.append(blocks[h])
        ids = np.concatenate(parts)[:n_in] if parts else np.empty(0, dtype=np.int64)
        if ids.shape[0] < n_in:  # tokens of its own beyond its blocks
            pad = np.random.default_rng([seed, 0x9AD, i]).integers(
                0, table.shape[0], size=n_in - ids.shape[0])
            ids = np.concatenate((ids, table[pad]))
        specs.append(RequestSpec(index=i, prompt_token_ids=tuple(ids.tolist()),
                                 max_tokens=n_out,
                                 send_at_s=round((req.t_s - t0) * time_scale, 6)))
    return Schedule(mode="open", requests=tuple(specs), seed=seed)
