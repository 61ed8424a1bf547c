"""A response surface over the knob grid of search_spaces/hybrid-mtp.yaml that costs no GPU.

The setting: Nemotron-3-Nano-30B-A3B shape + 1 MTP layer on one H200, vLLM 0.26, the case
study's traffic (512 in / 512 out, 256 closed-loop streams), objective = output tokens/s.

Every cell (a valid combination of knob values) gets a noise-free value from, in order:

1. **measured** rows (``measured.csv`` beside this file, plus any ``--measured CSV``): the
   mean of the rows for that cell. Out of the box only two cells are measured on an H200
   (docs/reference/gpu-measurements.md): vLLM's defaults with ``--max-num-seqs 256``
   (10,920 out tok/s) and MTP 1 + FlashInfer + FP16 state + stochastic rounding (13,172).
2. **modelled**: :func:`model` below, a multiplicative model anchored on those two cells,
   with the case study's public steps (6,058 -> ~7,000 MTP3+OMP1 -> async -> 7,800
   FlashInfer -> 9,500 MTP1 -> 11,840 FP16+SR, on another GPU) setting the *proportions*
   of the MTP / FlashInfer / FP16+SR gains, and the engine facts in
   docs/reference/vllm-0.26-engine-knobs.md setting memory limits and interactions.

Each evaluation multiplies the cell's value by log-normal noise (sigma 7 % by default; the
same config measured 21 % apart on two starts on the H200). Cells whose Mamba state does
not fit in memory are start failures ("oom"), as on the GPU. See results.md.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# --- anchors (measured on an H200, docs/reference/gpu-measurements.md) ---------------------
STREAMS = 256
DEFAULTS_256 = 10_920.0  # depth 0, async on, triton, fp32 state, max-num-seqs 256, no prefix cache
# MTP 1 + FlashInfer + FP16 + SR = 13,172: a total gain of 13,172 / 10,920 = 1.2062 over it.

# The case study's gains (other GPU) for the same three steps: MTP1 (with OMP 1) vs none
# 7,000/6,058 * 9,500/7,800 = 1.407, FlashInfer 7,800/7,350 = 1.061 (async taken as the
# remaining 7,350/7,000 = 1.05), FP16+SR 11,840/9,500 = 1.246. On the H200 the three together
# gave 1.2062, so each is scaled in log space by log(1.2062)/log(1.407*1.061*1.246) = 0.302:
_SCALE = math.log(13_172 / 10_920) / math.log(1.407 * 1.061 * 1.246)
GAIN_MTP1 = 1.407**_SCALE  # 1.109
GAIN_FLASHINFER = 1.061**_SCALE  # 1.018
GAIN_FP16_SR = 1.246**_SCALE  # 1.068
GAIN_ASYNC = 1.05**_SCALE  # 1.015 (off: divide)

# MTP depth d: throughput x L(d) / (1 + ALPHA + BETA * d * load), L = the space's synthetic
# acceptance lengths, load = running streams / 256 (a less busy GPU verifies drafts cheaper:
# the depth x concurrency interaction). ALPHA (fixed draft overhead) and BETA are fitted so
# that MTP1 = GAIN_MTP1 and MTP3 without full-graph coverage = GAIN_MTP1 / (1.218 ** _SCALE)
# (the case study's MTP3 -> MTP1 step, scaled like the others).
ACCEPT = {1: 1.7, 2: 2.12, 3: 2.372}
GRAPH_MISS = 0.95  # decode batches above the CUDA-graph capture size run piecewise
_G3 = GAIN_MTP1 / 1.218**_SCALE
BETA = (ACCEPT[3] * GRAPH_MISS / _G3 - ACCEPT[1] / GAIN_MTP1) / 2.0
ALPHA = ACCEPT[1] / GAIN_MTP1 - 1.0 - BETA

# memory (GiB): H200 141, weights 61 (30B + MTP layer, bf16), activations/graphs/torch 4;
# Mamba state per request per (1 + depth) copy: 52 MiB fp32, 26 MiB fp16/bf16 (from the
# engine-knob notes: fp32 k=1 ~27 GiB and k=3 ~51 GiB at 256 requests); attention KV:
# 6 layers x 2 heads x 128 x 2 x 2 B = 6 KiB/token (fp8: 3 KiB), 1024 tokens per request.
GPU_GIB, WEIGHTS_GIB, OVERHEAD_GIB, COVER_GRAPHS_GIB = 141.0, 61.0, 4.0, 1.5
STATE_MIB = {"float32": 52.0, "float16": 26.0, "bfloat16": 26.0}

KNOBS = (
    "mtp_depth", "async_scheduling", "mamba_backend", "mamba_ssm_cache_dtype",
    "stochastic_rounding", "omp_threads", "max_num_seqs", "max_num_batched_tokens",
    "cudagraph_cover_drafts", "gpu_memory_utilization", "kv_cache_dtype",
    "enable_chunked_prefill", "enable_prefix_caching", "performance_mode",
)  # fmt: skip


def capture_limit(p: Mapping[str, Any]) -> int:
    """CUDA-graph capture size: vLLM 0.26's default, or the space's derived one."""
    d = int(p.get("mtp_depth") or 0)
    seqs, mnbt = int(p["max_num_seqs"]), int(p["max_num_batched_tokens"])
    if p.get("cudagraph_cover_drafts"):
        return min(seqs * (1 + d), mnbt, 2048)
    return min(seqs * (1 + d) * 2, 512, mnbt)


def model(p: Mapping[str, Any], accept: Mapping[int, float] = ACCEPT) -> tuple[float | None, str]:
    """(modelled out tok/s, "") for a cell, or (None, reason) for a start failure.

    ``accept``: MTP acceptance length per depth (a sensitivity knob of the benchmark).
    """
    d = int(p.get("mtp_depth") or 0)
    seqs, mnbt = int(p["max_num_seqs"]), int(p["max_num_batched_tokens"])
    dtype = str(p["mamba_ssm_cache_dtype"])
    fi = p["mamba_backend"] == "flashinfer"
    cover = bool(p.get("cudagraph_cover_drafts"))
    gmu = float(p["gpu_memory_utilization"])
    fp8 = p["kv_cache_dtype"] == "fp8"
    running = min(seqs, STREAMS)
    limit = capture_limit(p)

    # -- start failures: vLLM needs max_num_seqs Mamba cache blocks (FULL graphs), each
    # holding 1 + depth state copies; bigger graph pools need memory outside the budget.
    avail = GPU_GIB * gmu - WEIGHTS_GIB - OVERHEAD_GIB - (COVER_GRAPHS_GIB if cover else 0.0)
    kv = running * 1024 * (3.0 if fp8 else 6.0) / 2**20
    need = seqs * (1 + d) * STATE_MIB[dtype] / 1024 + kv
    if need > avail:
        return None, "oom"
    if cover and gmu >= 0.95 and limit >= 1024:
        return None, "oom"  # capturing >= 1024-token graphs beyond a 95 % budget

    v = DEFAULTS_256 * (running / STREAMS) ** 0.7  # fewer running streams: less batching
    if d:
        v *= accept[d] / (1.0 + ALPHA + BETA * d * running / STREAMS)
    if running * (1 + d) > limit:
        v *= GRAPH_MISS
    if running * (1 + d) > mnbt / 2:
        v *= 0.97  # decode tokens crowd out prefill chunks
    v *= {2048: 0.93, 4096: 0.98, 8192: 1.0, 16384: 0.995}[mnbt]  # prefill chunking
    if not p["async_scheduling"]:
        v /= GAIN_ASYNC * (1.02 if d else 1.0)  # drafting makes the CPU gap larger
    if fi:
        v *= GAIN_FLASHINFER
    if dtype != "float32":
        # half the state bytes; stochastic rounding costs a little of it back
        v *= GAIN_FP16_SR if p.get("stochastic_rounding") else GAIN_FP16_SR * 1.004
    if p.get("omp_threads") == 1 and d:
        v *= 1.005  # the case study set OMP 1 with MTP: less CPU contention while drafting
    if fp8:
        v *= 1.005  # 6 of 52 layers are attention: fp8 KV saves little at 1k tokens
    if not p["enable_chunked_prefill"]:
        v *= 0.94  # whole 512-token prefills stall decode steps
    if p["enable_prefix_caching"]:
        v *= 0.97  # random prompts never hit; Mamba 'align' mode costs copies
    v *= {128: 1.0, 256: 1.0, 512: 0.998, 1024: 0.995}[seqs]  # scheduler bookkeeping
    if need > 0.9 * avail:
        v *= 0.98  # few spare blocks: occasional preemption
    return v, ""


def cell_key(p: Mapping[str, Any]) -> tuple[Any, ...]:
    """The cell of a config (inactive or unset knobs as None; OMP unset = the torch default)."""
    q = dict(p)
    if q.get("omp_threads") is None:
        q["omp_threads"] = 8  # unset: torch uses all cores, like 8
    return tuple(_norm(q.get(k)) for k in KNOBS)


def _norm(v: Any) -> Any:
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        try:
            return float(low) if "." in low else int(low)
        except ValueError:
            return v.strip()
    if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
        return int(v)
    return v


def read_measured(path: Path) -> list[tuple[dict[str, Any], float | None, str]]:
    """Rows of a measured CSV: (knob values, out tok/s or None for a failed start, source).

    Columns: the knob names (or ``param.<knob>`` as in a study's trials.csv), and
    ``output_tokens_per_s`` (or ``metric.output_tokens_per_s``); an empty value with a
    ``state`` of failed means a start failure. Blank knob cells = inactive knob.
    """
    rows: list[tuple[dict[str, Any], float | None, str]] = []
    with path.open(newline="") as f:
        for i, raw in enumerate(csv.DictReader(f), start=2):
            r = {k.removeprefix("param.").removeprefix("metric."): (v or "").strip()
                 for k, v in raw.items() if k}
            params = {k: _norm(r[k]) for k in KNOBS if r.get(k, "") != ""}
            missing = [k for k in ("max_num_seqs", "max_num_batched_tokens",
                                   "mamba_ssm_cache_dtype") if k not in params]
            if missing:
                raise SystemExit(f"{path} line {i}: no value for {', '.join(missing)}")
            text = r.get("output_tokens_per_s", "")
            if text:  # an SLO miss ("infeasible") still measured its throughput
                value: float | None = float(text)
            elif r.get("state", "failed") == "failed" and r.get("reason") != "rejected":
                value = None  # the server did not start or died: a failed cell
            else:
                continue  # never launched
            rows.append((params, value, r.get("source", path.name)))
    return rows


class Surface:
    """Noise-free value of every cell: measured rows first, the model elsewhere."""

    def __init__(self, measured: list[tuple[dict[str, Any], float | None, str]],
                 accept: Mapping[int, float] = ACCEPT) -> None:
        self.accept = dict(accept)
        acc: dict[tuple[Any, ...], list[float | None]] = {}
        self.sources: dict[tuple[Any, ...], str] = {}
        for params, value, source in measured:
            key = cell_key(params)
            acc.setdefault(key, []).append(value)
            self.sources[key] = source
        self.measured: dict[tuple[Any, ...], float | None] = {}
        for key, vals in acc.items():
            ok = [v for v in vals if v is not None]
            # a cell that started at least once is feasible: its mean reading is its value
            self.measured[key] = sum(ok) / len(ok) if ok else None

    def value(self, p: Mapping[str, Any]) -> tuple[float | None, str, bool]:
        """(value or None, failure reason, measured?) of the cell of ``p``."""
        key = cell_key(p)
        if key in self.measured:
            v = self.measured[key]
            return v, "" if v is not None else "measured_failure", True
        v, reason = model(p, self.accept)
        return v, reason, False


def grid(space: Any) -> Iterator[dict[str, Any]]:
    """Every valid cell of ``space`` (conditions respected, rules applied)."""
    names = list(space.knobs)

    def values(k: Any) -> list[Any]:
        if k.type == "bool":
            return [False, True]
        if k.type == "categorical":
            return list(k.choices)
        return list(range(int(k.low), int(k.high) + 1))

    def rec(i: int, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if i == len(names):
            if not space.violations(params):
                yield dict(params)
            return
        n = names[i]
        if not space.is_active(n, params):
            yield from rec(i + 1, params)
            return
        for v in values(space.knobs[n]):
            params[n] = v
            yield from rec(i + 1, params)
            del params[n]

    yield from rec(0, {})
