"""Bounded session levels against an uncompressed replay of the same sessions, and the
fitted replay against the exact replay, on one CPU vLLM server (README.md): per trace,
every replay's prefix-cache counters and TTFT by turn, into a JSON file."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TRACES = ROOT / "tests" / "data" / "traces"
MOONCAKE = TRACES / "mooncake_fast25_conversation.jsonl"
SERVEGEN = TRACES / "servegen_offline_trace_a_head300.jsonl"

#: the cross-user trace's arrivals and answers, which its source does not record: Poisson
#: arrivals at this rate (requests/s, seed 0) and every answer this many tokens
SERVEGEN_RATE_RPS, SERVEGEN_OUTPUT = 4.0, 32
#: the ServeGen lengths' factor in the Mooncake-format file (16-token blocks as 512)
SERVEGEN_UP = 32

#: per trace: the trace's prefix block (tokens), the replay's block (the length scale is
#: their ratio), the time scale of every replay of it
SETUP: dict[str, dict[str, float]] = {
    "mooncake": {"trace_block": 512, "block": 16, "time_scale": 0.1},
    "servegen": {"trace_block": 512, "block": 16, "time_scale": 1.0},  # lengths x 32 in
    "think90": {"trace_block": 1, "block": 1, "time_scale": 0.2},
}


def servegen_trace(out: Path, *, rate_rps: float = SERVEGEN_RATE_RPS,
                   output_tokens: int = SERVEGEN_OUTPUT, seed: int = 0) -> Path:
    """The ServeGen excerpt (batch requests, no arrival times, no answers) as a Mooncake
    hash-id trace: Poisson arrivals at ``rate_rps`` in request order, every answer
    ``output_tokens`` long, the hash ids as recorded. Its blocks are 16 tokens and a
    Mooncake-format reader takes 512: every length is written x 32 (a block of the file is
    then 512 tokens), and the replay's length scale of 1/32 makes each 16 tokens again."""
    rows = [json.loads(x) for x in SERVEGEN.read_text().splitlines() if x.strip()]
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_rps, size=len(rows))
    t = np.concatenate(([0.0], np.cumsum(gaps[1:])))
    out.write_text("".join(json.dumps({
        "timestamp": round(float(ms)), "input_length": r["input_length"] * SERVEGEN_UP,
        "output_length": output_tokens * SERVEGEN_UP, "hash_ids": r["hash_ids"]}) + "\n"
        for r, ms in zip(rows, t * 1000.0, strict=True)))
    return out


def think90_trace(out: Path) -> Path:
    """The synthetic think-time trace of experiments/session_levels (its gen_trace.py)."""
    subprocess.run([sys.executable, str(ROOT / "experiments" / "session_levels" /
                                        "gen_trace.py"), str(out), "--seed", "0"],
                   check=True, capture_output=True)
    return out


def time_scaled(shape: Any, f: float) -> Any:
    """``shape`` with its sessions' times multiplied by ``f`` (think times, spans) and its
    session rate divided by it: what a bounded level at time scale ``f`` draws from."""
    s = shape.sessions

    def scale(d: Any) -> Any:
        if d is None or f == 1:
            return d
        q = [v * f for v in d.quantiles]
        return d.model_copy(update={"quantiles": q, "mean": d.mean * f, "std": d.std * f,
                                    "min": q[0], "p50": q[50], "p90": q[90], "p99": q[99],
                                    "max": q[100]})

    return shape.model_copy(update={"sessions": s.model_copy(update={
        "think_time_s": scale(s.think_time_s), "session_span_s": scale(s.session_span_s),
        "rate_sps": s.rate_sps / f})})


def trace_turns(records: Any) -> list[int]:
    """Each request's turn (0 = first) in the trace, from the session links the shape fit
    found (``read_trace(...).sessions``: a hash-id trace's request whose complete blocks
    extend an earlier request's is its next turn)."""
    links = records.sessions
    n = len(records.input_tokens)
    if links is None:
        return [0] * n
    parent = links.parent.tolist()
    turn = [0] * n
    for _ in range(64):  # a parent may come later in the file (a simultaneous arrival)
        new = [turn[p] + 1 if p >= 0 else 0 for p in parent]
        if new == turn:
            break
        turn = new
    return turn


def ttft_by_turn(records: Any, turns: list[int] | None = None) -> dict[str, Any]:
    """p50 TTFT (s) and counts of turn 1, 2 and 3+ (a record's ``turn``, else ``turns``
    by its index)."""
    groups: dict[str, list[float]] = {"1": [], "2": [], "3+": []}
    for r in records:
        t = r.turn if r.turn is not None else (turns[r.index] if turns else 0)
        if r.ok and r.first_token_s is not None:
            groups["1" if t == 0 else "2" if t == 1 else "3+"].append(
                r.first_token_s - r.send_s)
    return {k: {"n": len(v), "ttft_p50_s": round(statistics.median(v), 4) if v else None}
            for k, v in groups.items()}


def measured(server: Any, sched: Any, turns: list[int] | None = None) -> dict[str, Any]:
    """One replay: the server's prefix-cache counters over it, TTFT by turn."""
    from autotune.load import replay, snapshot_metrics
    from autotune.measure import server_figures

    before = snapshot_metrics(server.base_url)
    t0 = time.monotonic()
    run = replay(sched, base_url=server.base_url, model=server.served_model_name,
                 request_timeout_s=300.0)
    fig = server_figures(before, snapshot_metrics(server.base_url))
    q, h = fig.get("prefix_cache_queries") or 0.0, fig.get("prefix_cache_hits") or 0.0
    return {"wall_s": round(time.monotonic() - t0, 2), "requests": len(run.records),
            "failed": sum(not r.ok for r in run.records),
            "prompt_tokens_sent": sum(r.sent_prompt_tokens for r in run.records),
            "prefix_cache_queries": q, "prefix_cache_hits": h,
            "hit_rate_pct": round(100 * h / q, 2) if q else None,
            "ttft_by_turn": ttft_by_turn(run.records, turns)}


def bounded(server: Any, shape: Any, tokens: Any, *, seed: int, token_seed: int,
            window_s: float, context: int) -> dict[str, Any]:
    """One bounded level as a session capacity trial runs it at the recorded session
    rate: the steady state's window, its sessions' conversations so far primed (at most
    ``window_s``), then the window's turns; only the window is measured."""
    from autotune.load import steady_sessions
    from autotune.trial import prime_contexts

    sched = steady_sessions(shape, token_ids=tokens, rate_sps=shape.sessions.rate_sps,
                            window_s=window_s, seed=seed, token_seed=token_seed,
                            max_total_tokens=context).within_context()
    client = {"base_url": server.base_url, "model": server.served_model_name,
              "api": "completions", "request_timeout_s": 300.0}
    primed_s = prime_contexts(sched, client, window_s)  # type: ignore[arg-type]
    mid = sum(1 for s in sched.sessions if s.context)
    return {"primed_s": round(primed_s, 2), "sessions": len(sched.sessions),
            "mid_conversation": mid, **measured(server, sched)}


def run_trace(name: str, server: Any, tokens: Any, work: Path, a: argparse.Namespace
              ) -> dict[str, Any]:
    from autotune.load import exact_schedule, read_hash_trace, session_schedule
    from autotune.traffic import clip_shape, fit_shape, read_trace

    cfg = SETUP[name]
    path = {"mooncake": lambda: MOONCAKE,
            "servegen": lambda: servegen_trace(work / "servegen.jsonl"),
            "think90": lambda: think90_trace(work / "think90.jsonl")}[name]()
    ls, ts = cfg["block"] / cfg["trace_block"], cfg["time_scale"]
    records = read_trace(path)
    shape = fit_shape(records, name=name)
    s = shape.sessions
    if s is None:
        raise SystemExit(f"{name}: the fit found no sessions")
    # the bounded levels draw from the shape clipped to the replay's lengths and times
    level_shape = time_scaled(clip_shape(shape, scale_input=ls, scale_output=ls), ts)
    out: dict[str, Any] = {"trace": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT)
                           else path.name, "length_scale": ls, "time_scale": ts,
                           "shape_sessions": s.summary(), "replays": []}
    seq = iter(range(1000 * (1 + list(SETUP).index(name)), 10**6))  # distinct words a run

    def add(kind: str, seed: int, rec: dict[str, Any]) -> None:
        out["replays"].append({"kind": kind, "seed": seed, **rec})
        print(name, kind, seed, json.dumps({k: rec.get(k) for k in (
            "requests", "failed", "hit_rate_pct", "wall_s")}), file=sys.stderr, flush=True)

    if name != "think90":  # (c) the exact replay: traces with hash ids
        reqs = read_hash_trace(path)
        exact = exact_schedule(reqs, token_ids=tokens, block_tokens=int(cfg["block"]),
                               trace_block_tokens=int(cfg["trace_block"]), time_scale=ts,
                               max_total_tokens=a.context, seed=next(seq))
        add("exact", 0, measured(server, exact, trace_turns(records)))
    # (b) the reference, uncompressed: the fitted sessions at the recorded session rate,
    # every turn at its drawn think time (x the time scale), no duration bound
    for seed in range(a.reference_seeds if name != "think90" else 1):
        n = s.sessions if name != "think90" else a.think90_sessions
        sched = session_schedule(shape, token_ids=tokens, seed=seed, num_sessions=n,
                                 time_scale=ts, length_scale=ls,
                                 max_total_tokens=a.context, token_seed=next(seq))
        add("reference", seed, measured(server, sched))
    # (a) the bounded levels: windows of the steady state at the same session rate
    for seed in range(a.seeds):
        add("bounded", seed, bounded(server, level_shape, tokens, seed=seed,
                                     token_seed=next(seq), window_s=a.window_s,
                                     context=a.context))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--traces", default="mooncake,servegen,think90")
    p.add_argument("--seeds", type=int, default=3, help="bounded levels per trace")
    p.add_argument("--reference-seeds", type=int, default=3,
                   help="uncompressed fitted replays per trace (think90: 1)")
    p.add_argument("--think90-sessions", type=int, default=1200)
    p.add_argument("--window-s", type=float, default=20.0)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--merge", action="store_true",
                   help="keep the other traces of an existing --out; replace these")
    a = p.parse_args()
    from autotune.engine import VllmServer, detect_engine, generate_tiny_model
    from autotune.load import model_prompts

    work = Path(tempfile.mkdtemp(prefix="session-bounded-"))
    model = generate_tiny_model(work / "tiny-llama", arch="llama")
    tokens = model_prompts(model).token_ids
    server = VllmServer(model=str(model), flags=["--max-model-len", str(a.context), "-O0"],
                        log_path=work / "server.log", start_timeout_s=600)
    out: dict[str, Any] = {
        "engine": detect_engine().version, "context": a.context, "window_s": a.window_s,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "servegen_arrivals": {"rate_rps": SERVEGEN_RATE_RPS, "output_tokens":
                              SERVEGEN_OUTPUT, "seed": 0},
        "command": " ".join(sys.argv), "traces": {}}
    if a.merge and a.out.is_file():
        kept = json.loads(a.out.read_text())
        out["traces"] = kept["traces"]
        out["earlier"] = {k: kept[k] for k in ("date", "commit", "command") if k in kept}
    server.start()
    try:
        server.wait_healthy()
        for name in a.traces.split(","):
            out["traces"][name] = run_trace(name, server, tokens, work, a)
            a.out.write_text(json.dumps(out, indent=1) + "\n")  # each trace as it ends
    finally:
        server.stop()
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
