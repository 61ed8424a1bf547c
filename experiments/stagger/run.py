"""Staggered vs lockstep closed-loop streams: the segment-to-segment spread of output tok/s.

One CPU vLLM server (the tiny llama) serves, in alternating order, closed-loop runs of
``--streams`` streams with (a) fixed lengths (every request IN in / OUT out, the case
study's 512/512 scaled down) and (b) lengths drawn from a recorded shape, each with the
streams' first requests staggered (``autotune.load.staggered``) and without. Each run
is cut into segments of ``--every`` completions (default max(streams, 16), autotune's);
the first ``--skip`` segments are the warm-up. Reported per run: the CV (std / mean) of
the segment rates, and of 1-second time slices (where lockstep waves show directly).

    python experiments/stagger/run.py --out experiments/stagger/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


class Record:
    """A SegmentControl that never stops the run early: it notes every segment's end."""

    def __init__(self, every: int, n: int) -> None:
        self.segment_requests = every
        self.n = n
        self.seen: list[tuple[float, int]] = []

    def on_segment(self, t_s: float, tokens: int, failed: int) -> bool:
        self.seen.append((t_s, tokens))
        return len(self.seen) >= self.n


def cv(values: list[float]) -> float:
    return float(np.std(values, ddof=1) / np.mean(values)) if len(values) > 1 else float("nan")


def one_run(server, shape, *, streams: int, every: int, stagger: bool, segments: int,
            skip: int, seed: int) -> dict:
    from autotune.load import replay
    from autotune.traffic import build_schedule

    sched = build_schedule(shape, vocab_size=8192, seed=seed, mode="closed",
                           concurrency=streams, num_requests=every * (segments + 2),
                           max_input_tokens=900, max_output_tokens=900)
    ctl = Record(every, segments)
    run = replay(sched, base_url=server.base_url, model=server.served_model_name,
                 control=ctl, stagger=stagger)
    t = [0.0] + [s[0] for s in ctl.seen]
    k = [0] + [s[1] for s in ctl.seen]
    rates = [(k[i + 1] - k[i]) / (t[i + 1] - t[i]) for i in range(len(t) - 1)][skip:]
    # 1-second slices over the measured part, by chunk arrival
    t0, t1 = t[skip], t[-1]
    times = np.array([c for r in run.records if r.ok for c in r.chunk_times_s])
    toks = np.array([n for r in run.records if r.ok for n in r.chunk_tokens], dtype=float)
    edges = np.arange(t0, t1, 1.0)
    slices = []
    if edges.size >= 3:
        sums, _ = np.histogram(times, bins=edges, weights=toks)
        slices = [float(x) for x in sums]
    return {"segment_rates": [round(r, 1) for r in rates], "segment_cv": cv(rates),
            "slice_cv": cv(slices) if slices else None, "mean_tok_s": float(np.mean(rates)),
            "seconds": round(t1 - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--fixed", type=int, nargs=2, default=(128, 128), metavar=("IN", "OUT"))
    p.add_argument("--shape", type=Path, default=REPO / "traffic" / "example-chat.json")
    p.add_argument("--every", type=int, default=None,
                   help="completions per segment (default max(streams, 16))")
    p.add_argument("--segments", type=int, default=15)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", type=Path, default=None, help="tiny model dir (default: make one)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    args = p.parse_args()

    from autotune.engine import VllmServer, detect_engine
    from autotune.engine import generate_tiny_model
    from autotune.traffic import LoadSpec, constant_shape, load_shape

    tmp = Path(tempfile.mkdtemp(prefix="stagger-"))
    model = args.model or generate_tiny_model(tmp / "tiny-llama", arch="llama", vocab_size=8192)
    load = LoadSpec(mode="closed", concurrency=args.streams, requests=args.streams * 4)
    shapes = {f"fixed {args.fixed[0]}/{args.fixed[1]}": constant_shape(*args.fixed, load=load),
              f"drawn ({args.shape.name})": load_shape(args.shape)}
    server = VllmServer(model=str(model), flags=["--max-model-len", "2048", "-O0"],
                        log_path=tmp / "server.log")
    server.start()
    rows = []
    try:
        server.wait_healthy()
        for rnd in range(args.rounds):
            for name, shape in shapes.items():
                for stagger in ((False, True) if rnd % 2 == 0 else (True, False)):
                    t = time.monotonic()
                    r = one_run(server, shape, streams=args.streams, stagger=stagger,
                                every=args.every or max(args.streams, 16),
                                segments=args.segments, skip=args.skip, seed=rnd)
                    r.update({"lengths": name, "stagger": stagger, "round": rnd})
                    rows.append(r)
                    slice_cv = r["slice_cv"] or float("nan")
                    print(f"{name:28s} stagger={stagger!s:5s} round {rnd}: segment CV "
                          f"{r['segment_cv']:.1%}, 1-s slice CV {slice_cv:.1%}, "
                          f"{r['mean_tok_s']:,.0f} tok/s ({time.monotonic() - t:.0f} s)",
                          flush=True)
    finally:
        server.stop()
    summary = {}
    for name in shapes:
        for stagger in (False, True):
            sel = [r for r in rows if r["lengths"] == name and r["stagger"] == stagger]
            summary[f"{name}, stagger={stagger}"] = {
                "segment_cv_median": statistics.median(r["segment_cv"] for r in sel),
                "segment_cv_runs": [round(r["segment_cv"], 4) for r in sel],
                "slice_cv_median": statistics.median(r["slice_cv"] for r in sel
                                                     if r["slice_cv"] is not None),
                "mean_tok_s": [round(r["mean_tok_s"]) for r in sel],
            }
    info = detect_engine()
    out = {"command": " ".join(sys.argv), "engine": f"{info.package} {info.version}",
           "streams": args.streams, "every": args.every or max(args.streams, 16),
           "segments": args.segments, "skip": args.skip,
           "summary": summary, "runs": rows}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
