"""Every script under experiments/ that needs no GPU and no vLLM server runs here at a tiny
size (seconds), so that a change of the library cannot leave one broken until its next
real run; every other script is named below with the reason it does not run here. A new
script must be added to one of the three tables (the last test fails otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXP = REPO / "experiments"

#: script -> (arguments, with {tmp} for a scratch folder; a file the run must write there)
RUNS: dict[str, tuple[list[str], str | None]] = {
    # the study loop with a simulated executor: 1 seed, 5 counted trials (the grid's summary
    # comes from grid-cache.json)
    "sample_efficiency/run.py": (["--seeds", "1", "--budget", "5", "--workers", "1",
                                  "--variants", "default,random", "--out", "{tmp}"],
                                 "results.json"),
    # the study before issue 67 and with its parts, a retune learning from a neighbour and
    # the retune with each part off in turn (trials read at two fidelities)
    "search_cost/run.py": (["--seeds", "1", "--budget", "5", "--workers", "1", "--out",
                            "{tmp}"], "results.json"),
    "store-races/race.py": (["optuna", "--processes", "2", "--rounds", "1"], None),
    "h200-trust/repeat-spread.py": (
        [str(EXP / "h200-trust/results-c256-jitter/bench-defaults-2-gpu0.json")], None),
    "h200-trust/stop-replay.py": ([], None),
    "h200-shapes/pooled.py": (["--out", "{tmp}/pooled.md"], "pooled.md"),
    "results.py": (["q1-azure"], None),
    # the synthetic think-time trace, a few minutes of it
    "session_levels/gen_trace.py": (["{tmp}/trace.jsonl", "--hours", "0.02"], "trace.jsonl"),
    # the rule's table from the committed runs
    "session_levels/summarize.py": ([], None),
}

#: scripts a test of their own runs
TESTED_ELSEWHERE = {
    "h200-shapes/matrix.py": "tests/unit/test_h200_shapes_matrix.py",
    "h200-shapes/dryrun.py": "tests/integration/test_h200_shapes_matrix.py",
    "h200-shapes/cells.py": "tests/integration/test_h200_shapes_matrix.py (through dryrun.py)",
    "h200-shapes/steps.py": "tests/unit/test_h200_shapes_matrix.py",
    "h200-kernels/e2e.py": "tests/unit/test_h200_kernels_e2e.py",
    "aa_verdict/summarize.py": "test_aa_verdict_counts_the_committed_studies (below)",
}

#: scripts that need a GPU, a vLLM server or rewrite their committed results in place
NOT_RUN = {
    "h200-kernels/compare.py": "times fused-MoE kernels on a CUDA GPU",
    "h200-kernels/profile_step.py": "profiles vLLM's decode step on a CUDA GPU",
    "h200-trust/preload-starts.py": "starts GPU vLLM servers",
    "h200-shapes/rejudge.py": "rewrites the committed studies' verdicts in place",
    "stagger/run.py": "starts a CPU vLLM server for minutes of replays",
    "session_fidelity/run.py": "starts a CPU vLLM server for minutes of replays",
    "session_fidelity/summarize.py": "rewrites its committed summary.csv in place",
    "session_bounded/run.py": "starts a CPU vLLM server for minutes of replays",
    "session_bounded/summarize.py": "rewrites its committed summary.csv in place",
    "capacity_resolution/summarize.py": "reads a GPU study's trials.csv (run.sh)",
    "loadgen_capacity/run.py": "pins load generator and stub servers to cores for minutes",
    "traffic_fit_bench/bench.py": "writes its committed results.json in place; minutes",
}


@pytest.mark.parametrize("script", sorted(RUNS))
def test_experiment_runs_at_a_tiny_size(script: str, tmp_path: Path) -> None:
    args, output = RUNS[script]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, str(EXP / script), *(a.replace("{tmp}", str(tmp_path)) for a in args)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    if output is not None:
        assert (tmp_path / output).stat().st_size > 0


def test_sample_efficiency_counts_every_trial(tmp_path: Path) -> None:
    """The tiny run's study counted its budget, and each run says what it found."""
    args, _ = RUNS["sample_efficiency/run.py"]
    subprocess.run([sys.executable, str(EXP / "sample_efficiency/run.py"),
                    *(a.replace("{tmp}", str(tmp_path)) for a in args)],
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True,
                   capture_output=True, timeout=300)
    result = json.loads((tmp_path / "results.json").read_text())
    assert {r["variant"] for r in result["runs"]} == {"default", "random"}
    assert result["surface"]["cells"] > 80_000
    for r in result["runs"]:
        assert 0.0 < r["final_ratio"] <= 1.0
        assert r["n_failed"] <= 5


def test_every_experiment_script_is_accounted_for() -> None:
    scripts = {str(p.relative_to(EXP)) for p in EXP.rglob("*.py")
               if "superseded" not in p.parts and p.name != "surface.py"}
    known = set(RUNS) | set(TESTED_ELSEWHERE) | set(NOT_RUN)
    assert scripts - known == set(), (
        "a script under experiments/ runs in no test: add it to RUNS (at a tiny size), "
        "TESTED_ELSEWHERE or NOT_RUN in tests/integration/test_experiments.py")
    assert known - scripts == set(), "scripts named here that no longer exist"


def test_aa_verdict_counts_the_committed_studies() -> None:
    """The A/A benchmark's count of its committed studies: every mode it ran is judged by
    its rule, and none printed WINNER."""
    results = sorted(str(p) for p in (EXP / "aa_verdict" / "results").glob("*.jsonl"))
    assert results
    proc = subprocess.run(
        [sys.executable, str(EXP / "aa_verdict/summarize.py"), "count", *results], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "recheck0:" in proc.stdout and "WINNER printed 0" in proc.stdout, proc.stdout
