"""The GPU runners under experiments/ and their polls: a poll waits only while the runner's
pid (RES/pid) is alive, so a runner that forgets to write it has its poll return at once
("NO JOB RUNNING") while the job runs on, unwatched, burning device time (the fifteenth
session's proof-x2.sh). Each runner is started for real with a staging folder that does not
exist: it must write its pid, then fail the install and mark itself DONE; the shared
poll library must then see a finished job, not a missing one."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO as ROOT

RUNNERS = ["experiments/h200-trust/proof-x2.sh", "experiments/h200-trust/run.sh",
           "experiments/h200-kernels/run.sh", "experiments/h200-shapes/run.sh"]


@pytest.mark.parametrize("runner", RUNNERS)
def test_runner_writes_pid_then_done(runner: str, tmp_path: Path) -> None:
    res = tmp_path / "res"
    env = {**os.environ, "HOME": str(tmp_path)}
    p = subprocess.run(["bash", runner, str(tmp_path / "nostage"), str(res), "30"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr[-2000:]
    assert (res / "pid").read_text().strip().isdigit()
    assert (res / "DONE").exists()
    # the poll library sees a finished job (0), not "no job running" (3)
    poll = subprocess.run(
        ["bash", "-c", f'. experiments/poll-lib.sh; wait_for "{res}" 20 test -f "{res}/DONE"'],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert poll.returncode == 0, poll.stdout


def test_poll_lib_returns_at_once_without_a_job(tmp_path: Path) -> None:
    res = tmp_path / "res"
    res.mkdir()
    poll = subprocess.run(
        ["bash", "-c", f'. experiments/poll-lib.sh; wait_for "{res}" 600 test -f "{res}/DONE"'],
        cwd=ROOT, env={**os.environ, "POLL_PID_GRACE": "2"}, capture_output=True, text=True,
        timeout=60)
    assert poll.returncode == 3
    assert "NO JOB RUNNING" in poll.stdout and "no pid file" in poll.stdout


def test_proof_runner_packs_the_caches_before_done(tmp_path: Path) -> None:
    """The `caches` step packs the compile caches in the background while the next step
    runs; DONE (what the last poll waits for before it copies the parts back) must come
    after the parts are complete. The sixteenth session's job marked DONE first and its poll
    brought back a truncated archive."""
    home = tmp_path / "home"
    (home / "site" / "vllm").mkdir(parents=True)  # installed: the runner skips install.sh
    model = home / "models" / "nemotron3-nano-30b-a3b-mtp"
    model.mkdir(parents=True)
    (model / "tokenizer.json").write_text("{}")
    cache = home / ".cache" / "autotune" / "triton"
    cache.mkdir(parents=True)
    for i in range(6):  # incompressible, so that packing takes a while
        (cache / f"kernel-{i}.bin").write_bytes(os.urandom(8 << 20))
    res = tmp_path / "res"
    env = {**os.environ, "HOME": str(home), "STEPS": "caches"}
    with open(tmp_path / "runner.log", "wb") as log:  # not a pipe: nothing waits on it
        proc = subprocess.Popen(["bash", "experiments/h200-trust/proof-x2.sh",
                                 str(tmp_path / "stage"), str(res), "300"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not (res / "DONE").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the runner did not finish"
            time.sleep(0.05)
        # what a poll would copy back the moment it sees DONE
        parts = sorted((home / "res-cache").glob("cache-part-*"))
        whole = subprocess.run(f"cat {' '.join(map(str, parts))} | tar tzf -", shell=True,
                               capture_output=True, text=True, timeout=120)
    finally:
        proc.wait(timeout=240)
    assert proc.returncode == 0, (tmp_path / "runner.log").read_text()[-2000:]
    assert len(parts) >= 3  # 48 MiB in 15 MB parts
    assert whole.returncode == 0, whole.stderr[-500:]
    assert sum(".bin" in line for line in whole.stdout.splitlines()) == 6
    assert "caches packed" in (res / "progress.txt").read_text()


def test_bytecode_step_compiles_once_where_python_writes_none(tmp_path: Path) -> None:
    """The GPU image sets PYTHONDONTWRITEBYTECODE and the bundle is installed without
    bytecode: every server start compiled vLLM again (~25 s a start). The runners compile
    the staged site once; where Python writes bytecode itself they leave it alone."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "mod.py").write_text("X = 1\n")

    def step(write: bool) -> str:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        if not write:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        return subprocess.run(["bash", "experiments/gpu-bytecode.sh", str(site)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120,
                              check=True).stdout

    assert step(write=True).startswith("bytecode: dont_write_bytecode=0")  # Python writes its own
    assert not list(site.rglob("*.pyc"))
    assert "the image writes no .pyc" in step(write=False)
    assert list(site.rglob("mod.*.pyc")) and (site / ".compiled").exists()
    assert "dont_write_bytecode=1, .pyc under" in step(write=False)  # once: not again
