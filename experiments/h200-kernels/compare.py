"""Kernel-level before/after: the fused-MoE call timed with the config vLLM itself picks
without a tuned folder (its shipped file or built-in default) and with
VLLM_TUNED_CONFIG_FOLDER=TUNED, at each token count of the tuned file and a few in between
(vLLM takes the nearest key), on one GPU. With a results file beside it, the tuned counts
and the points half-way between them (the guard keys, which hold vLLM's default, are
served there when nearer).

    python3 experiments/h200-kernels/compare.py --model DIR --tuned DIR --out kernel-compare.csv

Each timing is autotune's worker bench (vLLM's benchmark_moe.py method: 10 calls in a CUDA
graph, replays timed with CUDA events, fresh router logits each replay), ``--iters``
replays, repeated ``--repeats`` times interleaved (before, after, before, after, ...).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path


def _vllm_pick(shape, m: int, folder: str | None) -> dict:
    """The config vLLM 0.26's lookup returns for m tokens, with or without the folder."""
    import vllm.envs as envs
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    if folder is None:
        os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    else:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = folder
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    fm.get_moe_configs.cache_clear()
    w1 = (shape.experts, shape.w13_rows, shape.hidden)
    w2 = (shape.experts, shape.hidden, shape.intermediate)
    cfg = fm.try_get_optimal_moe_config(w1, w2, shape.topk, shape.config_dtype, m)
    return {k: int(cfg[k]) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K",
                                     "GROUP_SIZE_M", "num_warps", "num_stages")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--tuned", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from autotune.kernels import moe_shape_from_model
    from autotune.kernels._worker import _Bench

    shape = moe_shape_from_model(args.model)
    files = [p for p in args.tuned.glob("E=*.json") if not p.name.endswith(".results.json")]
    if not files:
        print(f"no tuned file in {args.tuned}", file=sys.stderr)
        return 2
    keys = sorted(int(k) for k in json.loads(files[0].read_text()) if k.isdigit())
    results = files[0].with_name(files[0].stem + ".results.json")
    if results.exists():  # the tuned counts only: the file's guard keys hold vLLM's default
        tuned = {int(r["m"]) for r in json.loads(results.read_text()).get("sizes", [])
                 if r.get("best")}
        keys = sorted(tuned) or keys
    between = [(a + b) // 2 for a, b in itertools.pairwise(keys)]
    sizes = sorted(set(keys) | set(between) | {1, 8})
    bench = _Bench({**asdict(shape), "activation": shape.activation}, seed=0)
    fields = ["m", "in_file", "before_us", "after_us", "speedup", "before_spread_us",
              "after_spread_us", "before_config", "after_config"]
    with open(args.out, "w", newline="") as f:  # row by row: a cut-off run keeps its rows
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for m in sizes:
            before, after = _vllm_pick(shape, m, None), _vllm_pick(shape, m, str(args.tuned))
            t_before, t_after = [], []
            for _ in range(args.repeats):
                t_before.append(bench.time(before, m, args.iters))
                t_after.append(bench.time(after, m, args.iters))
            b, a = statistics.median(t_before), statistics.median(t_after)
            w.writerow({"m": m, "in_file": m in keys, "before_us": round(b, 2),
                        "after_us": round(a, 2), "speedup": round(b / a, 3),
                        "before_spread_us": round(max(t_before) - min(t_before), 2),
                        "after_spread_us": round(max(t_after) - min(t_after), 2),
                        "before_config": json.dumps(before), "after_config": json.dumps(after)})
            f.flush()
            print(f"M={m}: {b:.1f} -> {a:.1f} us ({b / a:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
