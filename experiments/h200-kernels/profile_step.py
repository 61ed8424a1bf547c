"""Where one decode step's time goes: vLLM in-process, N steady decode steps under the torch
profiler, kernel time by category per step, and the CPU gaps between kernels.

    python3 experiments/h200-kernels/profile_step.py --model DIR --name defaults --streams 32 \
        --out profile.json [--mtp 1 --acceptance 1.7] [--tuned DIR] [--steps 30] \
        [--routing uniform_random]

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with vLLM's own step
scopes on (VLLM_CUSTOM_SCOPES_FOR_PROFILING=1: "gpu_model_runner: forward", "...: sample",
"...: draft"), so each GPU kernel is attributed through its launch (the CUDA runtime call with
the same correlation id, a CUDA-graph replay included) to the scope that launched it:
kernels launched in "draft" are the MTP head (mtp_head/<kind>), in "sample" sampling
(rejection sampling included), in "forward" by name: MoE (router top-k, align, fused_moe,
sum), attention, Mamba (conv1d, SSD chunk scan, state update), GEMM (the dense
projections), other. CPU gaps: the
profiled window's wall time minus the union of kernel intervals. Results are merged into
--out under --name.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

_MOE = re.compile(r"fused_moe|moe_align|moe_sum|topk|count_and_sort|grouped_topk|moe_", re.I)
_MAMBA = re.compile(r"mamba|ssd|chunk_scan|chunk_state|state_passing|bmm_chunk|causal_conv1d"
                    r"|selective_state|selective_scan|scan_update|ssu|conv1d|replay_ssm|_ssm", re.I)
_ATTN = re.compile(r"flash|attn|attention|fmha|reshape_and_cache|paged|mha|split_kv", re.I)
_GEMM = re.compile(r"gemm|nvjet|cutlass|sm90_xmma|matmul|cublas|splitk", re.I)


def _by_name(kernel: str) -> str:
    for cat, pat in (("moe", _MOE), ("mamba", _MAMBA), ("attention", _ATTN), ("gemm", _GEMM)):
        if pat.search(kernel):
            return cat
    return "other_kernels"


def _category(scope: str, kernel: str) -> str:
    """The main model's kernels by name; the MTP head's as mtp_head/<name category>."""
    if scope == "draft":
        return f"mtp_head/{_by_name(kernel)}"
    if scope == "sample":
        return "sampling"
    if scope != "forward":
        return "other_scopes"
    return _by_name(kernel)


def _analyse(trace: dict, steps: int) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    scopes = sorted(((e["ts"], e["ts"] + e["dur"], e["name"].split(": ", 1)[-1])
                     for e in events if e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith("gpu_model_runner: ")),
                    key=lambda s: s[1] - s[0])
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver")
              and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for k in kernels:
        t = launch.get(k.get("args", {}).get("correlation"))
        scope = next((s[2] for s in scopes if t is not None and s[0] <= t <= s[1]), "none")
        by_cat[_category(scope, k["name"])] += k["dur"]
        by_name[k["name"][:120]][0] += k["dur"]
        by_name[k["name"][:120]][1] += 1
        intervals.append((k["ts"], k["ts"] + k["dur"]))
    intervals.sort()
    busy, end = 0.0, None
    start = intervals[0][0] if intervals else 0.0
    for a, b in intervals:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    window = (end or 0.0) - start
    forwards = sum(1 for s in scopes if s[2] == "forward")
    n = max(1, steps)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "steps": steps, "forward_scopes": forwards,
        "step_ms": window / n / 1000, "gpu_busy_ms": busy / n / 1000,
        "cpu_gap_ms": (window - busy) / n / 1000,
        "categories_ms": {c: v / n / 1000 for c, v in sorted(by_cat.items())},
        "top_kernels": [{"name": k, "ms_per_step": v[0] / n / 1000, "calls_per_step": v[1] / n}
                        for k, v in top],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--mtp", type=int, default=0)
    ap.add_argument("--acceptance", type=float, default=1.7)
    ap.add_argument("--tuned", default=None, help="VLLM_TUNED_CONFIG_FOLDER")
    ap.add_argument("--routing", default="",
                    help="VLLM_MOE_ROUTING_SIMULATION_STRATEGY (uniform_random, normal_routing); "
                         "empty: the dummy weights' own routing (every token to the same "
                         "experts)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm-steps", type=int, default=20)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    if args.tuned:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = args.tuned
    if args.routing:
        os.environ["VLLM_MOE_ROUTING_SIMULATION_STRATEGY"] = args.routing
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict = {"model": args.model, "load_format": "dummy", "max_model_len": 2048,
                    "enable_prefix_caching": False, "gpu_memory_utilization": 0.9, "seed": 0}
    if args.mtp:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.mtp,
                                    "rejection_sample_method": "synthetic",
                                    "synthetic_acceptance_length": args.acceptance}
    t0 = time.monotonic()
    llm = LLM(**kw)
    start_s = time.monotonic() - t0
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1536, ignore_eos=True, temperature=1.0)
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    for i in range(args.streams):
        ids = [rng.randrange(1, vocab - 1) for _ in range(args.prompt)]
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params)
    lens: dict[str, int] = {}

    def step() -> None:  # outputs carry each request's tokens so far
        for out in engine.step():
            lens[out.request_id] = sum(len(o.token_ids) for o in getattr(out, "outputs", []))

    cuda = torch.cuda.is_available()  # False only in a CPU smoke test of this script
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warm_steps):  # prefill and the first decode steps
        step()
    sync()
    before = sum(lens.values())
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t1 = time.monotonic()
        for _ in range(args.steps):
            step()
        sync()
        wall = time.monotonic() - t1
    tokens = sum(lens.values()) - before
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    res = _analyse(trace, args.steps)
    res.update({"settings": vars(args) | {"out": str(args.out)}, "start_s": round(start_s, 1),
                "wall_ms_per_step_unprofiled_clock": wall / args.steps * 1000,
                "tokens_per_step": tokens / args.steps,
                "tokens_per_step_per_stream": tokens / args.steps / args.streams,
                "torch": torch.__version__})
    allres = json.loads(args.out.read_text()) if args.out.exists() else {}
    allres[args.name] = res
    args.out.write_text(json.dumps(allres, indent=2) + "\n")
    cats = ", ".join(f"{k} {v:.2f}" for k, v in res["categories_ms"].items())
    print(f"{args.name}: {res['step_ms']:.2f} ms/step (GPU {res['gpu_busy_ms']:.2f}, "
          f"gaps {res['cpu_gap_ms']:.2f}); {cats}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
