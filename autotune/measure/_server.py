"""The server's side of a measurement: vLLM's ``/metrics`` counters and histograms
between two snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autotune.load import (
    ServerSnapshot,
)

WARMUP_FRACTION = 0.1  # default warm-up: this share of the loaded span is left out
SUBWINDOWS = 5  # sub-windows for the within-run CV
_COUNTERS: dict[str, str] = {
    "generation_tokens": "vllm:generation_tokens",
    "prompt_tokens": "vllm:prompt_tokens",
    "preemptions": "vllm:num_preemptions",
    "spec_drafts": "vllm:spec_decode_num_drafts",
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "requests_success": "vllm:request_success",
}
_HISTOGRAMS: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "tpot": "vllm:request_time_per_output_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue_time": "vllm:request_queue_time_seconds",
    "prefill_time": "vllm:request_prefill_time_seconds",
    "decode_time": "vllm:request_decode_time_seconds",
}
_ITERATION_TOKENS = "vllm:iteration_tokens_total"
_GAUGES: dict[str, str] = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "requests_running": "vllm:num_requests_running",
    "requests_waiting": "vllm:num_requests_waiting",
}


def server_figures(
    before: ServerSnapshot,
    after: ServerSnapshot,
    samples: Sequence[ServerSnapshot] = (),
) -> dict[str, float]:
    """Server-side figures between two snapshots (pure).

    Counter deltas (``generation_tokens``, ``preemptions``, ...), their rate over the
    snapshots' interval (``generation_tokens_per_s``), spec-decode ``spec_acceptance_rate``
    (accepted / draft tokens) and ``spec_acceptance_length`` (1 + accepted / drafts),
    ``prefix_cache_hit_rate`` (hits / queries), histogram means over the interval
    (``ttft_mean_s``, ...), the engine's steps (``engine_steps``, ``engine_steps_per_s``,
    ``step_ms``: wall time per step, ``tokens_per_step`` computed and
    ``generated_tokens_per_step``, from ``vllm:iteration_tokens_total``), and gauges
    (``kv_cache_usage`` mean and ``_max`` over ``samples``, else the ``after`` value).
    Figures that cannot be computed are left out.
    """
    out: dict[str, float] = {}
    dt = after.taken_at - before.taken_at
    if dt > 0:
        out["interval_s"] = dt
    delta: dict[str, float] = {}
    for key, fam in _COUNTERS.items():
        if fam in after.counters:
            d = after.counters[fam] - before.counters.get(fam, 0.0)
            if d >= 0:  # a negative delta means the server restarted in between
                delta[key] = d
                out[key] = d
    if "generation_tokens" in delta and dt > 0:
        out["generation_tokens_per_s"] = delta["generation_tokens"] / dt
    if delta.get("spec_draft_tokens", 0) > 0 and "spec_accepted_tokens" in delta:
        out["spec_acceptance_rate"] = delta["spec_accepted_tokens"] / delta["spec_draft_tokens"]
    if delta.get("spec_drafts", 0) > 0 and "spec_accepted_tokens" in delta:
        out["spec_acceptance_length"] = 1.0 + delta["spec_accepted_tokens"] / delta["spec_drafts"]
    if delta.get("prefix_cache_queries", 0) > 0 and "prefix_cache_hits" in delta:
        out["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / delta["prefix_cache_queries"]
    for key, fam in _HISTOGRAMS.items():
        if fam in after.histograms:
            s1, c1 = after.histograms[fam]
            s0, c0 = before.histograms.get(fam, (0.0, 0.0))
            if c1 - c0 > 0 and s1 - s0 >= 0:
                out[f"{key}_mean_s"] = (s1 - s0) / (c1 - c0)
    if _ITERATION_TOKENS in after.histograms:  # engine steps: how often, how full, how long
        s1, c1 = after.histograms[_ITERATION_TOKENS]
        s0, c0 = before.histograms.get(_ITERATION_TOKENS, (0.0, 0.0))
        steps = c1 - c0
        if steps > 0 and s1 - s0 >= 0:
            out["engine_steps"] = steps
            out["tokens_per_step"] = (s1 - s0) / steps
            if dt > 0:
                out["engine_steps_per_s"] = steps / dt
                out["step_ms"] = dt / steps * 1000.0
            if "generation_tokens" in delta:
                out["generated_tokens_per_step"] = delta["generation_tokens"] / steps
    for key, fam in _GAUGES.items():
        vals = [s.gauges[fam] for s in samples if fam in s.gauges]
        if vals:
            out[key] = float(np.mean(vals))
            out[f"{key}_max"] = float(np.max(vals))
        elif fam in after.gauges:
            out[key] = after.gauges[fam]
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}
