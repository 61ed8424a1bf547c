"""`autotune retune` on a recorded, bursty public trace, end to end on the CPU (issue 46).

The way a user takes it: an earlier study (the example chat shape, closed loop), then the
Azure conversation trace fitted with `shape fit` and clipped for the tiny model with
`shape clip --scale-input 0.125`. Its replay is open loop (recorded arrivals), so the study's
objective follows the traffic: capacity, not the arrivals' own tokens/s. Real CPU vLLM
servers, SQLite Optuna, MLflow in tmp_path; no Ray (tested elsewhere) to keep CI time down.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, needs_vllm

SPACE = str(REPO / "search_spaces" / "cpu.yaml")
#: the trace's first rows: the test reads the same whether the fixture holds the whole
#: trace or an excerpt of it
ROWS = 2000


def _cli(cwd: Path, *argv: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def _fit_clipped(traces: Path, tmp: Path) -> Path:
    lines = (traces / "azure2023_conv.csv").read_text().splitlines(keepends=True)
    trace = tmp / "azure2023_conv.csv"
    trace.write_text("".join(lines[: ROWS + 1]))  # the header and the first rows
    fitted, clipped = tmp / "azure.json", tmp / "azure-clipped.json"
    for argv in (("shape", "fit", str(trace), "-o", str(fitted)),
                 ("shape", "clip", str(fitted), "--scale-input", "0.125", "-o", str(clipped))):
        proc = _cli(tmp, *argv, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return clipped


@needs_vllm
@pytest.mark.slow
def test_retune_on_a_bursty_public_trace_ends_with_a_verdict(
        tiny_hybrid: Path, shared_traces: Path, tmp_path: Path) -> None:
    import optuna

    from autotune.traffic import load_shape

    storage = f"sqlite:///{tmp_path}/optuna.db"
    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    common = ("--model", str(tiny_hybrid), "--space", SPACE, "--storage", storage,
              "--tracking-uri", tracking, "--cache-dir", str(tmp_path / "cache"),
              "--no-ray", "--no-quality-probe", "--recheck", "0", "-q")
    # the earlier study: vLLM's defaults on the example chat shape, the shortest measurement
    chat = str(REPO / "traffic" / "example-chat.json")
    earlier = _cli(tmp_path, "tune", *common, "--shape", chat, "--trials", "1",
                   "--study-name", "earlier", "--out", str(tmp_path / "out1"),
                   "--num-requests", "16", "--concurrency", "4", "--segment-requests", "4",
                   "--precision", "0.2", "--warmup-max-s", "4", "--measure-max-s", "4")
    assert earlier.returncode == 0, (earlier.stdout + earlier.stderr)[-5000:]

    clipped = _fit_clipped(shared_traces, tmp_path)
    shape = load_shape(clipped)
    assert shape.load.mode == "open" and shape.rate_rps > 0  # recorded arrivals
    assert shape.arrivals is not None and (shape.arrivals.dispersion_60s or 0) > 2  # bursty

    # throughput on recorded arrivals is refused at once, with the ways out
    refused = _cli(tmp_path, "retune", *common, "--shape", str(clipped),
                   "--objective", "throughput", timeout=120)
    assert refused.returncode == 2 and "ranks nothing" in refused.stderr
    assert "--concurrency N" in refused.stderr

    # defaults otherwise, but for CI time: a shorter warm-up cap (the level search has
    # none: it runs until its bracket is within the tolerance)
    proc = _cli(tmp_path, "retune", *common, "--shape", str(clipped), "--trials", "1",
                "--top-k", "1", "--no-baseline", "--study-name", "retuned",
                "--out", str(tmp_path / "out2"), "--warmup-max-s", "40")
    out = proc.stdout + proc.stderr
    assert "DRIFTED" in proc.stdout and "warm-started from study earlier" in proc.stdout, out
    assert proc.returncode in (0, 1), out[-5000:]
    assert "verdict:" in proc.stdout or "no trial met the constraints" in proc.stdout, out
    assert re.search(r"interval \d[\d.,]*-\d", proc.stdout) is None  # "[a, b]", not "a-b"

    study = optuna.load_study(study_name="retuned", storage=storage)
    assert study.user_attrs["autotune.settings"]["objective"] == "capacity"  # auto, open loop
    ours = [t for t in study.trials if not t.user_attrs.get("autotune.prior")
            and t.user_attrs.get("autotune.reason") != "rejected"]
    assert len(ours) == 1 and ours[0].user_attrs.get("autotune.enqueued") is True
    t = ours[0]
    assert t.user_attrs.get("autotune.state") in ("ok", "infeasible"), t.user_attrs
    cap = t.user_attrs["autotune.capacity"]
    # the bracket closed: a pass and a fail at most 1.25x apart
    assert cap["status"] == "found", (cap["status"], t.user_attrs.get("autotune.message"))
    assert cap["low"] is not None and cap["high"] is not None
    assert cap["high"] / cap["low"] <= 1.25 + 1e-9 and len(cap["levels"]) >= 2
    warm = t.user_attrs["autotune.warmup"]
    assert warm["rule"] == "steady_state" and warm["seconds"] <= 40 + 15
    m = t.user_attrs["autotune.metrics"]
    for key, value in m.items():  # no negative interval (nor figure) anywhere
        if key.endswith(("_ci_low", "_ci_high")) or key in ("capacity_rps",):
            assert value >= 0, (key, value)
    if t.user_attrs["autotune.state"] == "ok":
        assert m["capacity_rps"] > 0 and m["capacity_rps_ci_low"] <= m["capacity_rps"]
        best = json.loads((tmp_path / "out2" / "best.json").read_text())
        assert best["capacity"]["capacity_rps"] > 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tiny_hybrid) not in ps  # no server of ours left running
