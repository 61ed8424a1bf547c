"""Benchmark: time to read + fit traffic shapes, and memory on a large file.

    python experiments/traffic_fit_bench/bench.py [--traces ../shared/traces] [--big-rows N]

Measures (wall clock, best and median of --repeats runs, in this process):
- the Azure conversation trace (19,366 rows; target: under 5 s on the 2-core dev machine),
- the Mooncake conversation trace (12,031 JSONL lines with prefix block ids),
and, each in a fresh subprocess so that peak RSS is its own:
- a synthetic Azure-format CSV of --big-rows rows (default 2,000,000, ~70 MB),
- a synthetic Mooncake-format JSONL of --big-rows/4 lines,
to show that memory stays bounded (chunked reading keeps numeric arrays only).

Writes results.json and results.md beside this script (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_TRACES = REPO.parent / "shared" / "traces"

# VmHWM (peak RSS of this process image) rather than ru_maxrss, which Linux carries over
# from the parent across exec
_CHILD = r"""
import json, re, sys, time
def hwm():
    with open("/proc/self/status") as fh:
        return int(re.search(r"VmHWM:\s+(\d+)", fh.read()).group(1)) / 1024
from autotune.traffic import fit_shape, read_trace
base = hwm()
t0 = time.perf_counter()
records = read_trace(sys.argv[1])
t1 = time.perf_counter()
shape = fit_shape(records)
t2 = time.perf_counter()
print(json.dumps({"rows": len(records), "read_s": t1 - t0, "fit_s": t2 - t1,
                  "rss_after_imports_mb": base,
                  "peak_rss_mb": hwm(),
                  "fingerprint": shape.fingerprint}))
"""


def _time_fit(path: Path, repeats: int) -> dict[str, Any]:
    from autotune.traffic import fit_shape, read_trace

    totals, reads, fits = [], [], []
    fingerprint = ""
    rows = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        records = read_trace(path)
        t1 = time.perf_counter()
        shape = fit_shape(records)
        t2 = time.perf_counter()
        reads.append(t1 - t0)
        fits.append(t2 - t1)
        totals.append(t2 - t0)
        fingerprint, rows = shape.fingerprint, len(records)
    return {
        "file": path.name,
        "rows": rows,
        "repeats": repeats,
        "total_s_best": round(min(totals), 4),
        "total_s_median": round(statistics.median(totals), 4),
        "read_s_median": round(statistics.median(reads), 4),
        "fit_s_median": round(statistics.median(fits), 4),
        "fingerprint": fingerprint,
    }


def _write_big_csv(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    start = np.datetime64("2024-05-01T00:00:00", "ns")
    gaps = rng.exponential(0.2e9, rows).astype(np.int64)
    ts = (start + np.cumsum(gaps).astype("timedelta64[ns]")).astype(str)
    inp = rng.lognormal(6.8, 0.9, rows).astype(np.int64) + 1
    out = rng.lognormal(4.9, 0.8, rows).astype(np.int64) + 1
    with path.open("w", encoding="utf-8") as fh:
        fh.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        step = 500_000
        for i in range(0, rows, step):
            lines = [
                f"{t.replace('T', ' ')},{a},{b}"
                for t, a, b in zip(
                    ts[i : i + step], inp[i : i + step], out[i : i + step], strict=True
                )
            ]
            fh.write("\n".join(lines) + "\n")


def _write_big_jsonl(path: Path, lines: int) -> None:
    rng = np.random.default_rng(1)
    ts = np.cumsum(rng.exponential(300, lines)).astype(np.int64)
    inp = rng.lognormal(8.5, 1.0, lines).astype(np.int64) + 1
    out = rng.lognormal(5.5, 0.7, lines).astype(np.int64) + 1
    next_id = 1
    with path.open("w", encoding="utf-8") as fh:
        for t, a, b in zip(ts, inp, out, strict=True):
            nblocks = -(-int(a) // 512)
            ids = [0, *range(next_id, next_id + nblocks - 1)]
            next_id += nblocks - 1
            fh.write(
                json.dumps(
                    {
                        "timestamp": int(t),
                        "input_length": int(a),
                        "output_length": int(b),
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )


def _child(path: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["file_mb"] = round(path.stat().st_size / 2**20, 1)
    for k in ("read_s", "fit_s", "rss_after_imports_mb", "peak_rss_mb"):
        result[k] = round(result[k], 2)
    return result


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# Traffic fit benchmark",
        "",
        f"Run {res['date']} on {env['cpus']} CPU(s), {env['machine']}, Python {env['python']},",
        f"numpy {env['numpy']}, pandas {env['pandas']}. Command: `{res['command']}`.",
        "",
        "## Real traces (read + fit, in process)",
        "",
        "| file | rows | best s | median s | read s | fit s | target |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["traces"]:
        target = (
            "< 5 s: " + ("met" if r["total_s_best"] < 5 else "MISSED")
            if r["file"].startswith("azure")
            else ""
        )
        lines.append(
            f"| {r['file']} | {r['rows']:,} | {r['total_s_best']:.3f} | "
            f"{r['total_s_median']:.3f} | {r['read_s_median']:.3f} | {r['fit_s_median']:.3f} | "
            f"{target} |"
        )
    lines += [
        "",
        "## Large synthetic files (fresh subprocess each; peak RSS of that process)",
        "",
        "| file | MB | rows | read s | fit s | RSS after imports MB | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["large"]:
        lines.append(
            f"| {r['kind']} | {r['file_mb']} | {r['rows']:,} | {r['read_s']} | {r['fit_s']} | "
            f"{r['rss_after_imports_mb']} | {r['peak_rss_mb']} |"
        )
    lines += [
        "",
        (
            "Peak RSS minus RSS after imports is what reading and fitting cost: one CSV chunk "
            "of 200,000 rows as strings, the numeric arrays (24 bytes per request, 8 per "
            "Mooncake block id) and the temporaries of sorting and fitting them; never the "
            "file's text. It grows with the number of requests, not with the bytes per line."
        ),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    import pandas as pd

    parser = argparse.ArgumentParser(description="time traffic-shape fitting")
    parser.add_argument(
        "--traces", type=Path, default=DEFAULT_TRACES, help="folder with the public trace samples"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per real trace")
    parser.add_argument(
        "--big-rows",
        type=int,
        default=2_000_000,
        help="rows of the synthetic CSV (0 = skip the large-file runs)",
    )
    args = parser.parse_args()

    traces = [
        args.traces / "azure2023_conv.csv",
        args.traces / "mooncake_fast25_conversation.jsonl",
    ]
    results: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python experiments/traffic_fit_bench/bench.py "
        f"--repeats {args.repeats} --big-rows {args.big_rows}",
        "environment": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "pandas": pd.__version__,
        },
        "traces": [_time_fit(p, args.repeats) for p in traces if p.is_file()],
        "large": [],
    }
    if args.big_rows > 0:
        with tempfile.TemporaryDirectory() as tmp:
            csv_path = Path(tmp) / "big_azure.csv"
            _write_big_csv(csv_path, args.big_rows)
            results["large"].append({"kind": "Azure-format CSV", **_child(csv_path)})
            csv_path.unlink()
            jsonl_path = Path(tmp) / "big_mooncake.jsonl"
            _write_big_jsonl(jsonl_path, args.big_rows // 4)
            results["large"].append({"kind": "Mooncake-format JSONL", **_child(jsonl_path)})
    _atomic_write(HERE / "results.json", json.dumps(results, indent=2) + "\n")
    _atomic_write(HERE / "results.md", _markdown(results))
    print(_markdown(results))


if __name__ == "__main__":
    main()
