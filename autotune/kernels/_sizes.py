"""Which token counts (the kernel's M) a traffic shape makes vLLM's MoE layers run.

vLLM looks a tuned config up by the batch's token count, taking the nearest key of the
JSON file (``try_get_optimal_moe_config``: ``min(keys, key=lambda k: abs(k - M))``), so a
file needs keys only where the traffic's steps land:

* **decode**: every running stream contributes ``1 + MTP depth`` tokens per step (the
  verify batch of speculative decoding), padded up to the CUDA-graph capture size vLLM
  replays (``1, 2, 4, 8, 16, 24, ..., 256, 272, ...``: steps of 8 up to 256, then 16);
  a step runs at most ``max_num_seqs`` sequences, so with fewer seqs than streams the
  step holds ``max_num_seqs`` of them (the rest wait in vLLM's queue);
* **mixed**: a decode step that also carries one prompt's prefill chunk
  (decodes + the shape's median prompt, at most ``max_num_batched_tokens``);
* **prefill**: a full chunk, ``max_num_batched_tokens`` (or all the streams' prompts
  when they are fewer);
* **draft**: with MTP depth >= 2, the MTP head's later draft steps run on one token per
  stream (its first runs on the verify batch, already a decode size).

The number of streams is the shape's closed-loop concurrency, or for an open loop the
concurrency the shape records (Little's law over the logged latencies), else the replay
rate times the mean latency at an assumed speed (stated in the reason). Every kind above
is counted for each number of sequences a step can hold, ``min(streams, max_num_seqs)``
for each ``--max-num-seqs`` value the server may run (:func:`active_streams`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.traffic import TrafficShape

__all__ = ["TokenCount", "TokenCountRecord", "active_streams", "cudagraph_size", "streams_of",
           "token_counts"]

# vLLM 0.26's defaults for the OpenAI server on a large GPU (>= 70 GiB, not an A100:
# EngineArgs._set_default_args): max_num_batched_tokens and max_num_seqs
DEFAULT_MAX_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 1024
# vLLM's default capture limit (min(2 * seqs * (1 + depth), 512)); beyond it steps run eager
DEFAULT_MAX_CAPTURE = 512
# open loop without a recorded latency: an assumed reference server (as traffic/ does)
_ASSUMED_TPOT_S = 0.02
_ASSUMED_PREFILL_TPS = 20_000.0


class TokenCountRecord(TypedDict):
    """A :class:`TokenCount` in ``results.json`` (a row's ``traffic``)."""

    m: int
    kinds: list[str]
    why: str


@dataclass(frozen=True)
class TokenCount:
    """One key of the tuned file: ``m`` tokens per MoE call and why the traffic makes it."""

    m: int
    kinds: tuple[str, ...]  # "decode", "mixed", "prefill", "draft"
    why: str

    def as_dict(self) -> TokenCountRecord:
        return {"m": self.m, "kinds": list(self.kinds), "why": self.why}


def cudagraph_size(tokens: int, max_capture: int = DEFAULT_MAX_CAPTURE) -> int:
    """The CUDA-graph batch vLLM pads a decode step of ``tokens`` to (eager above the
    capture limit: no padding)."""
    if tokens <= 0:
        raise ConfigError(f"a step has {tokens} tokens; it must have at least 1")
    if tokens > max_capture:
        return tokens
    if tokens <= 4:
        return 1 << (tokens - 1).bit_length()  # 1, 2, 4
    step = 8 if tokens <= 256 else 16
    return min(max_capture, -(-tokens // step) * step)


def streams_of(shape: TrafficShape, concurrency: int | None = None) -> tuple[int, str]:
    """The number of concurrent streams the shape's replay runs, and where it came from."""
    if concurrency is not None:
        if concurrency < 1:
            raise ConfigError(f"--concurrency {concurrency}: it must be >= 1")
        return concurrency, f"--concurrency {concurrency}"
    load = shape.load
    if load.mode == "closed" and load.concurrency:
        return int(load.concurrency), f"closed loop, {load.concurrency} streams"
    if shape.concurrency is not None and shape.concurrency.mean > 0:
        n = max(1, round(shape.concurrency.mean))
        return n, f"open loop, {shape.concurrency.mean:.1f} in flight ({shape.concurrency.method})"
    rate = (load.rate_rps or shape.rate_rps or 0.0) / load.time_scale
    if rate > 0:
        latency = (shape.input_tokens.mean / _ASSUMED_PREFILL_TPS
                   + shape.output_tokens.mean * _ASSUMED_TPOT_S)
        n = max(1, math.ceil(rate * latency))
        return n, (f"open loop, {rate:.2f} req/s x {latency:.1f} s assumed latency "
                   f"({_ASSUMED_TPOT_S * 1000:.0f} ms/token)")
    raise ConfigError(
        f"shape {shape.name!r} says neither its concurrency nor its rate; pass --concurrency N")


def active_streams(streams: int, max_num_seqs: Iterable[int] = (DEFAULT_MAX_NUM_SEQS,)
                   ) -> tuple[int, ...]:
    """The numbers of sequences one engine step can hold: ``min(streams, s)`` for each
    ``--max-num-seqs`` value ``s`` the server may run (sorted, each once)."""
    seqs = sorted(set(max_num_seqs))
    if not seqs or any(s < 1 for s in seqs):
        raise ConfigError(f"--max-num-seqs {seqs}: values must be >= 1")
    return tuple(sorted({min(streams, s) for s in seqs}))


def token_counts(shape: TrafficShape, *, mtp_depths: Iterable[int] = (0,),
                 max_batched_tokens: Sequence[int] = (DEFAULT_MAX_BATCHED_TOKENS,),
                 max_num_seqs: Iterable[int] = (DEFAULT_MAX_NUM_SEQS,),
                 concurrency: int | None = None, max_capture: int = DEFAULT_MAX_CAPTURE,
                 extra: Iterable[int] = ()) -> list[TokenCount]:
    """The token counts to tune for ``shape`` (sorted, each once, with its reasons), for
    every MTP depth, chunk size and ``--max-num-seqs`` value the server may run."""
    streams, source = streams_of(shape, concurrency)
    depths = sorted(set(mtp_depths))
    if not depths or any(d < 0 for d in depths):
        raise ConfigError(f"--mtp-depth {depths}: depths must be >= 0")
    if not max_batched_tokens or any(b < 1 for b in max_batched_tokens):
        raise ConfigError(f"--max-batched-tokens {list(max_batched_tokens)}: must be >= 1")
    prompt = max(1, round(shape.input_tokens.p50))
    found: dict[int, list[tuple[str, str]]] = {}

    def add(m: int, kind: str, why: str) -> None:
        found.setdefault(int(m), []).append((kind, why))

    for n in active_streams(streams, max_num_seqs):
        held = f"{n} streams" if n == streams else f"{n} streams (--max-num-seqs {n})"
        for d in depths:
            per_step = n * (1 + d)
            mtp = f", MTP {d}" if d else ""
            add(cudagraph_size(per_step, max_capture), "decode",
                f"{held} x {1 + d} tokens{mtp}")
            if d >= 2:
                add(cudagraph_size(n, max_capture), "draft",
                    f"MTP draft steps 2..{d}: {n} tokens")
            for cap in max_batched_tokens:
                if per_step < cap:
                    add(min(cap, per_step + prompt), "mixed",
                        f"{per_step} decode tokens{mtp} + a {prompt}-token prompt (chunk {cap})")
        for cap in max_batched_tokens:
            add(min(cap, n * prompt), "prefill",
                f"prefill chunk: min(max_num_batched_tokens {cap}, {n} x {prompt})")
    for m in extra:
        if m < 1:
            raise ConfigError(f"--sizes {m}: token counts must be >= 1")
        add(m, "extra", "asked for (--sizes)")
    out = []
    for m in sorted(found):
        kinds = tuple(dict.fromkeys(k for k, _ in found[m]))
        out.append(TokenCount(m=m, kinds=kinds,
                              why=f"{source}: " + "; ".join(dict.fromkeys(w for _, w in found[m]))))
    return out
