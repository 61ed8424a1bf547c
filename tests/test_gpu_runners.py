"""The GPU runners under experiments/ and their polls: a poll waits only while the runner's
pid (RES/pid) is alive, so a runner that forgets to write it has its poll return at once
("NO JOB RUNNING") while the job runs on, unwatched, burning device time (the fifteenth
session's proof-x2.sh). Each runner is started for real with a staging folder that does not
exist: it must write its pid, then fail the install and mark itself DONE; the shared
poll library must then see a finished job, not a missing one."""

from __future__ import annotations

import os
import subprocess
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
