"""Faults of the stores around a study: MLflow down, the Optuna storage busy or locked, no
space left for the study's files. Provoked for real: a closed port, a real MLflow tracking
server that is killed, ``BEGIN EXCLUSIVE`` from another SQLite connection, a 64 KiB tmpfs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults._lab import (
    VERDICT_EXITS,
    Lab,
    check_best_json,
    check_trials_csv,
    file_has,
    run_cli,
    state_of,
    tagged,
    wait_for,
    wait_gone,
)

pytestmark = pytest.mark.faults


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- MLflow -------------------------------------------------------------------------------------


def test_mlflow_server_down_fails_fast_with_a_clear_message(lab: Lab) -> None:
    """--tracking-uri of a tracking server that is down: exit 2 with a message that names
    the URL, before any server starts, in seconds (MLflow's own HTTP retries must not make
    the user wait minutes for it)."""
    url = f"http://127.0.0.1:{closed_port()}"
    argv = lab.argv(lab.space("ok"), trials=1)
    argv[argv.index("--tracking-uri") + 1] = url
    rc, took = lab.run_bounded(argv, "run", 35)
    _, err = lab.output("run")
    assert lab.n_launches() == 0  # no server was started for a study that cannot be tracked
    assert wait_gone(lab.tag, 5) == []
    assert rc is not None, f"still waiting for MLflow {took:.0f} s after the start"
    assert rc == 2 and url in err and "Traceback" not in err, err[-2000:]


def test_mlflow_down_leaves_nothing_that_blocks_the_next_run(
    lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the failed start the user fixes --tracking-uri and runs the same command:
    it must start the study, not refuse because the failed run left a study behind."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail in seconds, not minutes
    argv = lab.argv(lab.space("ok"), trials=1)
    down = list(argv)
    down[down.index("--tracking-uri") + 1] = f"http://127.0.0.1:{closed_port()}"
    rc, _, err = run_cli(down)
    assert rc == 2 and "MLflow" in err, err[-2000:]
    assert lab.n_launches() == 0

    rc, _, err = run_cli(argv)  # the same command, with a store that works
    assert rc in VERDICT_EXITS, err[-2000:]
    assert [state_of(t) for t in lab.trials()] == [("COMPLETE", None)]


@pytest.fixture
def mlflow_server(lab: Lab) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real MLflow tracking server (MLflow's own REST app on werkzeug, SQLite behind it)."""
    port = closed_port()
    code = (
        "from werkzeug.serving import make_server\n"
        "from mlflow.server import app\n"
        f"make_server('127.0.0.1', {port}, app, threaded=True).serve_forever()\n"
    )
    env = lab.env(
        _MLFLOW_SERVER_FILE_STORE=f"sqlite:///{lab.root / 'mlflow-server.db'}",
        _MLFLOW_SERVER_ARTIFACT_ROOT=str(lab.root / "mlflow-artifacts"),
    )
    log = open(lab.root / "mlflow-server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log, stderr=log,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health",
                                                                  timeout=2) as r:
            return r.status == 200
        assert proc.poll() is None, (lab.root / "mlflow-server.log").read_text()[-2000:]
        return False

    try:
        wait_for(healthy, 120, "the MLflow tracking server")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()


def test_mlflow_server_dying_mid_study_costs_warnings_not_the_study(
    lab: Lab, mlflow_server: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """The tracking server is killed while trial 0 is measured. The study must go on and
    finish promptly (MLflow writes fail as warnings), with every trial in Optuna."""
    url, server = mlflow_server
    argv = lab.argv(lab.space("slow,ok", AUTOTUNE_FAKE_CHUNK_S="0.02"), trials=2)
    argv[argv.index("--tracking-uri") + 1] = url
    tuner = lab.spawn(argv, "run")
    problems = []
    try:
        wait_for(lambda: file_has(lab.log(0), "fake-vllm: request") or tuner.poll() is not None,
                 120, "trial 0 to be measured")
        server.kill()
        killed_at = time.monotonic()
        # Trial 0 is measured in a few seconds: from then on it must be safe in Optuna,
        # whatever MLflow does (the storage is the source of truth).
        wait_for(lambda: not [p for p in tagged(lab.tag) if "vllm.entrypoints" in p.args]
                 or lab.log(1).exists(), 60, "the server of trial 0 to be stopped")
        time.sleep(3)
        if state_of(lab.trials()[0])[0] != "COMPLETE":
            problems.append(
                f"trial 0 was measured but is {state_of(lab.trials()[0])[0]} in Optuna "
                f"{time.monotonic() - killed_at:.0f} s after MLflow died: the tuner writes to "
                "MLflow before it commits the trial, so killing the stuck tuner now loses it")
        try:
            rc = tuner.wait(max(1.0, 30 - (time.monotonic() - killed_at)))
        except subprocess.TimeoutExpired:
            rc = None
            problems.append(f"the study was still stuck on the dead MLflow server "
                            f"{time.monotonic() - killed_at:.0f} s after it died")
    finally:
        if tuner.poll() is None:
            tuner.kill()
            tuner.wait()
    _, err = lab.output("run")
    if wait_gone(lab.tag, 10):
        problems.append("a server was left running")
    if rc is not None:
        if rc not in VERDICT_EXITS:
            problems.append(f"exit {rc}: {err[-1000:]}")
        if "MLflow: could not" not in err:  # said, not hidden
            problems.append("no 'MLflow: could not ...' warning on stderr")
        states = [state_of(t) for t in lab.trials()]
        if states != [("COMPLETE", None), ("COMPLETE", None)]:
            problems.append(f"trials in Optuna: {states}")
        if check_best_json(lab.out) is None:
            problems.append("no best.json")
    assert not problems, "\n".join(problems)


# -- the Optuna storage -------------------------------------------------------------------------


class ExclusiveLock:
    """``BEGIN EXCLUSIVE`` on a SQLite file from another connection, on its own thread
    (so the tuner, in this process, really waits on SQLite's file lock)."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.held = threading.Event()
        self.release = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, hold_s: float | None = None) -> None:
        def run() -> None:
            conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
            conn.execute("BEGIN EXCLUSIVE")
            self.held.set()
            self.release.wait(hold_s)
            conn.execute("ROLLBACK")
            conn.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self.held.wait(30)

    def drop(self) -> None:
        self.release.set()
        if self._thread is not None:
            self._thread.join(30)


def _create_storage(url: str) -> None:
    import optuna

    optuna.storages.RDBStorage(url)  # tables exist, as after any earlier study


def test_storage_busy_at_start_is_waited_out(lab: Lab) -> None:
    """Another process holds the storage for 3 s (a dashboard, a second tuner committing):
    the tuner waits for it and runs the study."""
    _create_storage(lab.storage)
    lock = ExclusiveLock(lab.root / "optuna.db")
    lock.take(hold_s=3.0)
    t0 = time.monotonic()
    try:
        rc, _, err = run_cli(lab.argv(lab.space("ok"), trials=1))
    finally:
        lock.drop()
    assert rc in VERDICT_EXITS, err[-2000:]
    assert time.monotonic() - t0 >= 2.5  # it waited for the lock
    assert [state_of(t) for t in lab.trials()] == [("COMPLETE", None)]
    assert wait_gone(lab.tag, 5) == []


def test_storage_locked_at_start_fails_clean(lab: Lab) -> None:
    """Locked for longer than the storage's lock timeout (1 s in this URL): exit 2 with a
    message, and no server started."""
    url = f"sqlite+pysqlite:///{lab.root / 'optuna.db'}?timeout=1"
    _create_storage(url)
    lock = ExclusiveLock(lab.root / "optuna.db")
    lock.take()
    try:
        rc, _, err = run_cli(lab.argv(lab.space("ok"), trials=1, storage=url))
    finally:
        lock.drop()
    assert rc == 2 and "locked" in err and "Traceback" not in err, err[-2000:]
    assert lab.n_launches() == 0


def test_storage_locked_mid_study_stops_clean_and_resume_finishes(lab: Lab) -> None:
    """The storage is locked (beyond its 1 s lock timeout) while trial 1 is measured, and
    stays locked until the tuner gives up. The tuner must stop with a clear message and
    exit 2 (not a traceback), keep trial 0, leave no server; once the lock is gone,
    --resume finishes the study."""
    url = f"sqlite+pysqlite:///{lab.root / 'optuna.db'}?timeout=1"
    argv = lab.argv(lab.space("ok,slow,ok", AUTOTUNE_FAKE_CHUNK_S="0.01"), trials=3,
                    storage=url)
    lock = ExclusiveLock(lab.root / "optuna.db")

    def lock_when_trial_1_measures() -> None:
        wait_for(lambda: file_has(lab.log(1), "fake-vllm: request"), 120, "trial 1")
        lock.take()

    locker = threading.Thread(target=lock_when_trial_1_measures, daemon=True)
    locker.start()
    problems = []
    try:
        try:
            rc, _, err = run_cli(argv)
        except BaseException as exc:  # noqa: BLE001 - what escapes the CLI is the finding
            rc, err = None, f"{type(exc).__name__}: {exc}"
            problems.append(f"the CLI raised {type(exc).__name__}: {str(exc)[:200]}")
        assert lock.held.is_set(), "the lock was never taken: trial 1 did not run"
        if wait_gone(lab.tag, 5):
            problems.append("a server was left running")
    finally:
        lock.drop()
        locker.join(30)
    assert [state_of(t) for t in lab.trials(url)][:1] == [("COMPLETE", None)]
    check_trials_csv(lab.out, lab.trials(url))
    if rc is not None and not (rc == 2 and "locked" in err and "Traceback" not in err):
        problems.append(f"exit code {rc}, stderr: {err[-500:]}")

    rc, _, err = run_cli([*argv, "--resume"])
    if rc not in VERDICT_EXITS:
        problems.append(f"--resume afterwards: exit {rc}: {err[-500:]}")
    else:
        states = [state_of(t) for t in lab.trials(url)]
        if states[0] != ("COMPLETE", None) or states[-1] != ("COMPLETE", None):
            problems.append(f"after --resume: {states}")
    assert not problems, "\n".join(problems)


# -- disk space ---------------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(lab: Lab) -> Iterator[Path]:
    """``lab.out`` on a 160 KiB tmpfs (skips where mounting is not allowed): room for a
    finished study's files (best.json, trials.csv, the plots: about 100 KiB in 4 KiB pages)
    once the chatty server log that filled it is gone."""
    lab.out.mkdir(parents=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(lab.out)],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield lab.out
    finally:
        for p in wait_gone(lab.tag, 5):  # a server holding a log open keeps the mount busy
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        if subprocess.run(["umount", str(lab.out)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(lab.out)], check=False)


def test_no_space_left_for_the_study_files(lab: Lab, tiny_tmpfs: Path) -> None:
    """--out on a 160 KiB file system; trial 0's server log fills it. The tuner must stop
    with a clear message naming the full disk and exit 2 (not a traceback), keep trial 0,
    leave no server, and leave nothing that breaks --resume once there is space again."""
    argv = lab.argv(lab.space("chatty:400,ok"), trials=2)
    problems = []
    try:
        rc, _, err = run_cli(argv)
    except BaseException as exc:  # noqa: BLE001 - what escapes the CLI is the finding
        rc, err = None, ""
        problems.append(f"the CLI raised {type(exc).__name__}: {exc}")
    assert file_has(lab.log(0), "INFO fake-vllm: xxxx")  # the disk did fill up
    if wait_gone(lab.tag, 5):
        problems.append("a server was left running")
    trials = lab.trials()
    assert state_of(trials[0]) == ("COMPLETE", None)
    check_trials_csv(lab.out, trials)  # absent or whole
    check_best_json(lab.out)
    if rc is not None and not (rc == 2 and "space" in err.lower() and "Traceback" not in err):
        problems.append(f"exit code {rc}, stderr: {err[-500:]}")

    lab.log(0).unlink()  # the user frees space
    rc, _, err = run_cli([*argv, "--resume"])
    if rc not in VERDICT_EXITS:
        files = {str(p.relative_to(tiny_tmpfs)): p.stat().st_size
                 for p in tiny_tmpfs.rglob("*") if p.is_file()}
        problems.append(f"--resume after freeing space: exit {rc}: {err[-500:]}; on the "
                        f"disk: {files}")
    else:
        # the next trial may have been submitted before the bookkeeping that hit the full
        # disk (a freed slot is refilled first): it was interrupted, and ran again now
        states = [state_of(t) for t in lab.trials()]
        assert [s for s in states if s != ("FAIL", "interrupted")] == [("COMPLETE", None)] * 2
        assert len(states) <= 3
        assert check_best_json(lab.out) is not None
    assert not problems, "\n".join(problems)
