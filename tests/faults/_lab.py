"""Helpers of the fault-injection suite: a fake vLLM, processes tagged per test, studies.

How faults are provoked (see docs/faults.md for the table):

* **a fake engine** where the fault is about the trial or the tuner: ``fake_vllm/`` holds a
  package ``vllm.entrypoints.openai.api_server``; a search space whose ``fixed_env`` puts it
  first on the server's ``PYTHONPATH`` makes the library launch it instead of vLLM, with
  the same argv, process group, parent-death signal, log file and stop sequence. No library
  hook or mock: the library runs unchanged. Its modes (exit, hang, die mid-measurement,
  failing or stalled requests, ...) are listed in its docstring; ``real`` execs the real
  vLLM in place, so one study can mix cheap fake trials with one real server;
* **real vLLM** (marked ``slow``) where the fault is about vLLM itself;
* real signals, a real tmpfs, a real memory cgroup, real SQLite locks, closed ports.

Every process a test starts carries ``AUTOTUNE_FAULT_TAG=<unique tag>`` in its
environment (inherited by Ray's processes, workers and servers), so "nothing left behind"
is checked by reading ``/proc/*/environ`` rather than guessing from command lines, and a
failing test can only ever kill its own processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import REPO

FAKE_VLLM = (Path(__file__).parent / "fake_vllm").resolve()
SHAPE = REPO / "traffic" / "example-chat.json"
TAG_VAR = "AUTOTUNE_FAULT_TAG"


# -- the process table ----------------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str
    args: str

    def __str__(self) -> str:
        return f"pid {self.pid} ppid {self.ppid} pgid {self.pgid} [{self.state}] {self.args[:120]}"


def tagged(tag: str) -> list[Proc]:
    """Live (non-zombie) processes whose environment carries ``AUTOTUNE_FAULT_TAG=tag``."""
    want = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if fields[0] == b"Z":
            continue
        found.append(Proc(int(entry.name), int(fields[1]), int(fields[2]), fields[0].decode(),
                          args))
    return found


def wait_gone(tag: str, timeout_s: float,
              where: Callable[[Proc], bool] = lambda p: True) -> list[Proc]:  # fmt: skip
    """Wait until no process of ``tag`` (``where`` says so) is alive; return what is still
    there at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p in tagged(tag) if where(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def kill_tagged(tag: str) -> list[Proc]:
    """SIGKILL every live process of ``tag`` (a failed test's leftovers), one pid at a time."""
    left = tagged(tag)
    for p in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    return left


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


def _default_sigint() -> None:
    """In the spawned tuner, Ctrl-C does what it does in a terminal, whoever runs the tests.

    A test run started in the background of a non-interactive shell (``cmd &``, as some CI
    wrappers do) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    handler: the SIGINT tests would test nothing.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def file_has(path: Path, text: str) -> bool:
    try:
        return text in path.read_text(errors="replace")
    except OSError:
        return False


# -- studies -------------------------------------------------------------------------------


def write_space(path: Path, *, plan: str, counter: Path, tag: str,
                knobs: str | None = None, flags: Sequence[str] = ("--max-model-len", "1024"),
                **env: str) -> Path:  # fmt: skip
    """A search space whose servers are the fake engine following ``plan``."""
    fixed_env = {
        "PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": plan,
        "AUTOTUNE_FAKE_COUNTER": str(counter), TAG_VAR: tag, **env,
    }  # fmt: skip
    knobs = knobs or (
        "  max_num_seqs:\n    type: int\n    low: 4\n    high: 16\n    flag: --max-num-seqs\n"
    )
    path.write_text(
        "name: fault\ndescription: the fake engine of the fault suite\n"
        f"fixed_flags: {json.dumps(list(flags))}\n"
        f"fixed_env: {json.dumps(fixed_env)}\n"
        f"knobs:\n{knobs}"
    )
    return path


@dataclass
class Lab:
    """One test's study: where things go, how to run the tuner, what it left."""

    root: Path
    tag: str
    model: Path
    mlflow_uri: str
    study: str = "s"

    @property
    def storage(self) -> str:
        return f"sqlite:///{self.root / 'optuna.db'}"

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def launches(self) -> Path:
        return self.root / "launches"

    def n_launches(self) -> int:
        return len(list(self.launches.glob("launch-*"))) if self.launches.exists() else 0

    def log(self, number: int) -> Path:
        return self.out / "logs" / f"trial-{number:04d}-server.log"

    def space(self, plan: str, name: str = "space.yaml", **env: str) -> Path:
        return write_space(self.root / name, plan=plan, counter=self.launches, tag=self.tag,
                           **env)

    def argv(self, space: Path, *, trials: int, extra: Sequence[str] = (),
             storage: str | None = None, ray: bool = False) -> list[str]:  # fmt: skip
        return [
            "tune", "--model", str(self.model), "--shape", str(SHAPE), "--space", str(space),
            "--trials", str(trials), "--storage", storage or self.storage,
            "--tracking-uri", self.mlflow_uri, "--experiment", self.tag,
            "--study-name", self.study, "--out", str(self.out), "--num-requests", "8",
            "--concurrency", "2", "--recheck", "0", "--start-timeout", "15",
            "--request-timeout", "5", "--cache-dir", str(self.root / "cache"),
            # short adaptive measurements (segments of 4 requests, 4 s caps): the suite
            # is about faults, not precision
            "--segment-requests", "4", "--warmup-max-s", "4", "--measure-max-s", "4",
            "--precision", "0.2", "--pruner", "none",
            # the plans fault trials by their order, not their config: a model of start
            # failures would steer a planned trial away
            "--no-failure-model",
            *([] if ray else ["--no-ray"]), *extra,
        ]  # fmt: skip

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, TAG_VAR: self.tag, "PYTHONUNBUFFERED": "1", **extra}

    def spawn(self, argv: Sequence[str], name: str, **env: str) -> subprocess.Popen[bytes]:
        """``python -m autotune ARGV`` in its own session, output in ROOT/NAME.{out,err}."""
        out = open(self.root / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        err = open(self.root / f"{name}.err", "wb")  # noqa: SIM115
        return subprocess.Popen(
            [sys.executable, "-m", "autotune", *argv], stdout=out, stderr=err,
            stdin=subprocess.DEVNULL, env=self.env(**env), cwd=self.root,
            start_new_session=True, preexec_fn=_default_sigint,  # noqa: PLW1509 - one call, no fork race that matters here
        )  # fmt: skip

    def run_bounded(self, argv: Sequence[str], name: str, timeout_s: float
                    ) -> tuple[int | None, float]:
        """Spawn the tuner and give it ``timeout_s`` to exit: (exit code, or None when it was
        still running and had to be killed; seconds it took)."""
        t0 = time.monotonic()
        tuner = self.spawn(argv, name)
        try:
            rc: int | None = tuner.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if tuner.poll() is None:
                tuner.kill()
                tuner.wait()
        return rc, time.monotonic() - t0

    def output(self, name: str) -> tuple[str, str]:
        return ((self.root / f"{name}.out").read_text(errors="replace"),
                (self.root / f"{name}.err").read_text(errors="replace"))

    def trials(self, storage: str | None = None) -> list[Any]:
        import optuna

        return optuna.load_study(study_name=self.study, storage=storage or self.storage).trials

    def runs(self) -> list[Any]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.mlflow_uri)
        exp = client.get_experiment_by_name(self.tag)
        return client.search_runs([exp.experiment_id]) if exp else []


def memory_cgroup_root() -> tuple[Path, str] | None:
    """(folder of this process's memory cgroup, limit file name), v1 or v2."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        for line in lines:
            if line.startswith("0::"):
                return Path("/sys/fs/cgroup") / line[3:].lstrip("/"), "memory.max"
    return None


#: the exit status of a study that ended with a verdict: 0, or 3 when its leader is
#: ``unconfirmed`` (a lead from one server start each: these studies run ``--recheck 0``)
VERDICT_EXITS = (0, 3)


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """``autotune ARGV`` in this process: (exit code, stdout, stderr). Exceptions escape."""
    from autotune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def state_of(t: Any) -> tuple[str, str | None]:
    """(Optuna state, autotune reason) of a trial."""
    return t.state.name, t.user_attrs.get("autotune.reason")


def check_trials_csv(out: Path, storage_trials: Sequence[Any]) -> None:
    """trials.csv is absent or whole, and agrees with the storage on every row it has."""
    import pandas as pd

    csv = out / "trials.csv"
    if not csv.exists():
        return
    df = pd.read_csv(csv)
    by_number = {t.number: t for t in storage_trials}
    for row in df.itertuples():
        t = by_number[int(row.number)]
        if t.state.name == "COMPLETE":
            assert abs(float(row.value) - t.value) < 1e-6 * max(1.0, abs(t.value))


def check_best_json(out: Path) -> dict[str, Any] | None:
    """best.json is absent or a whole JSON document with a serve command."""
    p = out / "best.json"
    if not p.exists():
        return None
    best = json.loads(p.read_text())
    assert best["serve_command"] and "params" in best
    return best
