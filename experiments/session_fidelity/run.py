"""Replay the Mooncake excerpt exactly and as its fitted sessions on one CPU vLLM server;
write every replay's server figures (README.md)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "traces" / "mooncake_fast25_conversation.jsonl"


def _replay(server: Any, sched: Any) -> dict[str, Any]:
    from autotune.load import replay, snapshot_metrics
    from autotune.measure import server_figures, session_figures

    before = snapshot_metrics(server.base_url)
    t0 = time.monotonic()
    run = replay(sched, base_url=server.base_url, model=server.served_model_name,
                 request_timeout_s=300.0)
    fig = server_figures(before, snapshot_metrics(server.base_url))
    return {"wall_s": round(time.monotonic() - t0, 2), "requests": len(run.records),
            "failed": sum(not r.ok for r in run.records),
            "prompt_tokens_sent": sum(r.sent_prompt_tokens for r in run.records),
            "server": {k: fig.get(k) for k in ("prefix_cache_queries", "prefix_cache_hits",
                                               "prefix_cache_hit_rate", "prompt_tokens",
                                               "preemptions", "kv_cache_usage")},
            "sessions": session_figures(run.records, run.wall_s)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=0.1)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    a = p.parse_args()
    from autotune.engine import VllmServer, detect_engine, generate_tiny_model
    from autotune.load import exact_schedule, model_prompts, read_hash_trace, session_schedule
    from autotune.traffic import fit_shape, read_trace

    scale = a.block_tokens / 512
    shape = fit_shape(read_trace(TRACE), name="mooncake-excerpt")
    assert shape.sessions is not None
    tmp = Path(tempfile.mkdtemp(prefix="session-fidelity-"))
    model = generate_tiny_model(tmp / "tiny-llama", arch="llama")
    tokens = model_prompts(model).token_ids
    server = VllmServer(model=str(model), flags=["--max-model-len", str(a.context), "-O0"],
                        log_path=tmp / "server.log", start_timeout_s=600)
    out: dict[str, Any] = {
        "trace": str(TRACE.relative_to(ROOT)), "block_tokens": a.block_tokens,
        "length_scale": scale, "time_scale": a.time_scale, "context": a.context,
        "engine": detect_engine().version, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime()),
        "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "shape_sessions": shape.sessions.summary(), "replays": []}
    server.start()
    try:
        server.wait_healthy()
        exact = exact_schedule(read_hash_trace(TRACE), token_ids=tokens,
                               block_tokens=a.block_tokens, time_scale=a.time_scale,
                               max_total_tokens=a.context)
        out["replays"].append({"kind": "exact", "seed": 0, **_replay(server, exact)})
        print(json.dumps(out["replays"][-1]["server"]), file=sys.stderr)
        for seed in range(a.seeds):
            sched = session_schedule(shape, token_ids=tokens, seed=seed,
                                     num_sessions=shape.sessions.sessions,
                                     time_scale=a.time_scale, length_scale=scale,
                                     max_total_tokens=a.context)
            out["replays"].append({"kind": "fitted", "seed": seed, **_replay(server, sched)})
            print(json.dumps(out["replays"][-1]["server"]), file=sys.stderr)
    finally:
        server.stop()
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
