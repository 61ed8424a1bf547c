"""The objective follows the traffic (autotune.objective): capacity for recorded arrivals,
throughput for a closed loop, and objectives that rank nothing refused before any server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from autotune.traffic import LoadSpec, load_shape, save_shape
from tests._objective import OPEN
from tests.conftest import REPO


def test_tune_refuses_throughput_on_a_fitted_trace_before_any_server(tmp_path: Path) -> None:
    # the CLI path a user takes: exit 2, one line, nothing started or stored
    shape = save_shape(load_shape(OPEN).with_load(LoadSpec(mode="open", requests=50)),
                       tmp_path / "prod.json")
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "tune", "--model", str(tmp_path / "no-model"),
         "--shape", str(shape), "--space", str(REPO / "search_spaces" / "cpu.yaml"),
         "--objective", "throughput", "--storage", f"sqlite:///{tmp_path}/o.db"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("autotune: error:")]
    assert len(lines) == 1 and "ranks nothing" in lines[0] and "--concurrency N" in lines[0]
    assert not (tmp_path / "o.db").exists()
