"""Ray: trials spread over a real two-node local Ray cluster joined with --ray-address."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autotune.engine import free_port
from tests.conftest import REPO, needs_vllm

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")


@needs_vllm
@pytest.mark.slow
@pytest.mark.skipif(RAY is None, reason="the ray command is not installed")
def test_two_node_ray_cluster_runs_trials_on_both_nodes(tiny_llama: Path, tmp_path: Path) -> None:
    import uuid

    import optuna
    from mlflow.tracking import MlflowClient

    from tests.faults._lab import TAG_VAR, kill_tagged, wait_gone

    port = free_port()
    # every process of this cluster carries the tag (Ray's daemons and workers inherit it):
    # stopped by it at the end, not by `ray stop --force`, which stops every Ray of the
    # machine (a study of another test running beside this one)
    tag = f"atf-two-node-{uuid.uuid4().hex[:8]}"
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"},
           "RAY_USAGE_STATS_ENABLED": "0", TAG_VAR: tag}
    head = [RAY, "start", "--head", f"--port={port}", "--num-cpus=1", "--num-gpus=0",
            "--include-dashboard=false"]
    try:
        subprocess.run(head, check=True, env=env, capture_output=True, timeout=180)
        # Ray 2.60: the head enables token auth and writes ~/.ray/auth_token; a joining node
        # must be told to send it. The tuner (no RAY_AUTH_MODE) finds the token itself.
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1",
                        "--num-gpus=0"], check=True, capture_output=True, timeout=180,
                       env={**env, "RAY_AUTH_MODE": "token"})
        storage = f"sqlite:///{tmp_path}/optuna.db"
        cmd = [
            sys.executable, "-m", "autotune", "tune", "--model", str(tiny_llama),
            "--shape", str(REPO / "traffic" / "example-chat.json"),
            "--space", str(REPO / "search_spaces" / "cpu.yaml"), "--trials", "2",
            "--parallel", "2", "--recheck", "0", "--no-baseline",
            # no quality reference (a vLLM start of its own, about 2 min here): this test is
            # about Ray's nodes and the Pareto front; the reference and the probe of lossy
            # trials under local Ray are tested in tests/e2e/test_study_e2e.py
            "--no-quality-probe",
            "--enqueue", '{"max_num_seqs": 8}', "--enqueue", '{"max_num_seqs": 16}',
            "--num-requests", "8", "--concurrency", "2", "--segment-requests", "4",
            "--precision", "0.1", "--warmup-max-s", "15", "--measure-max-s", "15",
            "--storage", storage, "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db",
            "--study-name", "cluster", "--out", str(tmp_path / "out"),
            "--ray-address", f"127.0.0.1:{port}",
            # and a multi-objective study (issue 6): throughput against p99 latency
            "--objective", "pareto",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env,
                              cwd=REPO)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        trials = optuna.load_study(study_name="cluster", storage=storage).get_trials()
        assert len(trials) == 2
        assert all(t.user_attrs.get("autotune.state") == "ok" for t in trials), [
            t.user_attrs.get("autotune.message") for t in trials]
        nodes = {t.user_attrs.get("autotune.ray_node_id") for t in trials}
        assert len(nodes) == 2 and "" not in nodes  # one trial on each node, at once

        # Pareto: both objectives stored, the front reported, plotted and logged.
        assert all(len(t.values) == 2 and t.values[1] > 0 for t in trials)
        best = json.loads((tmp_path / "out" / "best.json").read_text())
        front = best["pareto_front"]
        assert 1 <= len(front) <= 2 and best["pareto_latency"]
        key = best["pareto_latency"] + "_s"
        vals = {t.number: t.values for t in trials}
        for point in front:
            assert [point["output_tokens_per_s"], point[key]] == vals[point["trial"]]
            assert point["serve_command"].startswith("vllm serve ")
        if len(front) == 1:  # one dominates the other
            (a, b), (c, d) = vals.values()
            assert (a >= c and b <= d) or (c >= a and d <= b)
        assert (tmp_path / "out" / "plots" / "pareto_front.png").stat().st_size > 1000
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
        exp = client.get_experiment_by_name("autotune")
        parent = next(r for r in client.search_runs([exp.experiment_id])
                      if r.data.tags.get("autotune.kind") == "study")
        plots = {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
        assert "plots/pareto_front.png" in plots, plots

        # Without --ray-address a study starts a Ray of its own, though this cluster runs
        # here (Ray alone would join it, the latest `ray start`, and refuse num_cpus)
        import ray

        from autotune.exec import RayExecutor

        ex = RayExecutor()
        try:
            assert ray.get_runtime_context().gcs_address != f"127.0.0.1:{port}"
        finally:
            ex.shutdown()
    finally:
        kill_tagged(tag)
        left = wait_gone(tag, 30)
    assert left == []  # after the finally: a failure above is reported as itself


@pytest.mark.slow  # a local Ray start: about 10 s
def test_trial_phases_reach_the_driver_under_ray() -> None:
    """A trial's phases (starting, warming up, each capacity level, ...) travel from the Ray
    worker to the driver's display. An empty ray Queue is falsy (it has a length): the
    executor once took that for "no queue" and showed no phase at all under Ray."""
    import time

    from autotune.exec import RayExecutor
    from autotune.trial import TrialOutcome, TrialSpec

    def fn(spec: TrialSpec, on_phase: Any = None) -> TrialOutcome:
        for phase in ("starting", "warming_up", "capacity"):
            on_phase(spec.number, phase, 0.0, f"{phase} detail")
            time.sleep(1.2)  # the driver drains the queue once a second
        return TrialOutcome(number=spec.number, ok=True)

    ex = RayExecutor(fn=fn)
    try:
        got: list[tuple[Any, ...]] = []
        ex.submit(TrialSpec(number=7, model="m", flags=(), env={}, shape=None),
                  on_phase=lambda *a: got.append(a))
        done: list[TrialOutcome] = []
        while not done:
            done = ex.wait(1.0)
        assert done[0].ok, done[0].message
        assert [(n, p) for n, p, _, _ in got] == [(7, "starting"), (7, "warming_up"),
                                                  (7, "capacity")]
    finally:
        ex.shutdown()
