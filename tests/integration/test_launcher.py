"""Preloaded interpreters (autotune/engine/_launcher.py), with real processes: a tiny module
of our own is imported once by a launcher and run as ``__main__`` in a child forked per
start, with its own argv, environment, working directory and log."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from autotune.engine._launcher import (
    DIR_ENV,
    LaunchedProcess,
    _alive,
    _host,
    launch,
    launcher_key,
    preload_scope,
    scope_dir,
)

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
MODULE = "atl_pkg.main"

# Import-time state lives in the package (the launcher's import keeps it); the main module
# is run afresh as __main__ in each child, as ``python -m`` would.
_INIT = """
import os, tempfile
IMPORTED_PID = os.getpid()
IMPORT_VAR = os.environ.get("ATL_VAR")
IMPORT_TMP = tempfile.gettempdir()
os.environ["ATL_SET_AT_IMPORT"] = "set by the import"  # as vLLM's env_override does
os.environ.pop("ATL_DROPPED_AT_IMPORT", None)
"""
_MAIN = """
import json, os, signal, sys, tempfile, time
import atl_pkg

if __name__ == "__main__":
    print(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(),
        "imported_pid": atl_pkg.IMPORTED_PID, "import_var": atl_pkg.IMPORT_VAR,
        "import_tmp": atl_pkg.IMPORT_TMP, "var": os.environ.get("ATL_VAR"),
        "tmpdir": os.environ.get("TMPDIR"), "gettempdir": tempfile.gettempdir(),
        "cwd": os.getcwd(), "path0": sys.path[0], "argv": sys.argv[1:],
        "preload_dir": os.environ.get("AUTOTUNE_PRELOAD_DIR"),
        "set_at_import": os.environ.get("ATL_SET_AT_IMPORT"),
        "dropped_at_import": os.environ.get("ATL_DROPPED_AT_IMPORT"),
        "signals": {s.name: getattr(signal.getsignal(s), "name", None)
                    or getattr(signal.getsignal(s), "__name__", "?") for s in (
            signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
            signal.SIGCHLD, signal.SIGQUIT)},
    }), flush=True)
    if "sleep" in sys.argv[2:]:
        print("ready", flush=True)
        time.sleep(120)
    sys.exit(int(sys.argv[1]))
"""
_BAD = """
raise RuntimeError("atl_pkg.bad fails to import")
"""


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    """A folder to put on PYTHONPATH holding the package ``atl_pkg``."""
    pkg = tmp_path / "lib" / "atl_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(_INIT))
    (pkg / "main.py").write_text(textwrap.dedent(_MAIN))
    (pkg / "bad.py").write_text(textwrap.dedent(_BAD))
    return pkg.parent


@pytest.fixture(autouse=True)
def _no_outer_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DIR_ENV, raising=False)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short folder under the system's tmp (Unix socket paths are at most 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="atl-"))
    try:
        yield path
    finally:
        _stop_launchers_in(path)
        shutil.rmtree(path, ignore_errors=True)


def _env(lib: Path, tmp: Path, var: str = "one", **extra: str) -> dict[str, str]:
    tmp.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(lib),
            "ATL_VAR": var, "TMPDIR": str(tmp), **extra}


def _until(cond: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def _report(log: Path) -> dict:
    """The JSON line the child printed into its log."""
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no report in {log}: {log.read_text()!r}")


def _launcher_pid(folder: Path, key: str) -> int:
    return int((folder / f"{key}.pid").read_text().strip())


def _stop_launchers_in(folder: Path) -> None:
    pids = []
    for pid_file in folder.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pid_file.read_text().strip()))
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _kill(procs: list[LaunchedProcess]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)


def _start(folder: Path, env: dict[str, str], cwd: Path, log: Path, args: list[str],
           procs: list[LaunchedProcess], module: str = MODULE) -> LaunchedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    proc = launch(folder, PY, module, args, env, str(cwd), log, ready_timeout_s=20.0)
    assert proc is not None, f"launch failed; launcher logs: {_logs(folder)}"
    procs.append(proc)
    return proc


def _logs(folder: Path) -> str:
    return "\n".join(f"{p.name}: {p.read_text()}" for p in folder.glob("*.log"))


@contextlib.contextmanager
def _scope() -> Iterator[tuple[Path, list[LaunchedProcess], list[int]]]:
    """preload_scope() with cleanup: children killed, and the scope's launchers waited for
    after it closes."""
    procs: list[LaunchedProcess] = []
    launchers: list[int] = []
    try:
        with preload_scope() as folder:
            assert folder is not None
            try:
                yield folder, procs, launchers
            finally:
                _kill(procs)
                launchers += [int(p.read_text()) for p in folder.glob("*.pid")]
    finally:
        for pid in launchers:
            with contextlib.suppress(AssertionError):
                _until(lambda pid=pid: not _alive(pid), 5.0)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_same_env_forks_from_one_preloaded_launcher(lib: Path, tmp_path: Path) -> None:
    with _scope() as (folder, procs, _):
        env = _env(lib, tmp_path / "tmp")
        first = _start(folder, env, tmp_path / "cwd1", tmp_path / "one.log", ["0"], procs)
        second = _start(folder, env, tmp_path / "cwd2", tmp_path / "two.log",
                        ["3", "--flag", "x y"], procs)
        # (a launcher reports an exit when it next wakes: up to a second later, so the two
        # run side by side to keep this quick)
        assert first.wait(timeout=20) == 0
        assert second.key == first.key == launcher_key(PY, MODULE, env)
        assert [p.name for p in folder.glob("*.pid")] == [f"{first.key}.pid"]
        launcher = _launcher_pid(folder, first.key)

        assert second.wait(timeout=20) == 3
        assert second.returncode == 3 and second.poll() == 3
        out = _report(tmp_path / "two.log")
        # forked from the preloaded state: the import ran once, in the launcher
        assert out["imported_pid"] == launcher == out["ppid"]
        assert out["pid"] == second.pid != launcher
        assert out["argv"] == ["3", "--flag", "x y"]
        assert Path(out["cwd"]).resolve() == (tmp_path / "cwd2").resolve()
        assert Path(out["path0"]).resolve() == (tmp_path / "cwd2").resolve()
        assert out["var"] == out["import_var"] == "one"
        assert out["preload_dir"] is None  # not in the env given
        first_out = _report(tmp_path / "one.log")
        assert first_out["imported_pid"] == launcher and first_out["pid"] == first.pid
        assert first_out["argv"] == ["0"]


def test_another_env_gets_its_own_launcher(lib: Path, tmp_path: Path) -> None:
    with _scope() as (folder, procs, _):
        a = _start(folder, _env(lib, tmp_path / "tmp"), tmp_path / "cwd", tmp_path / "a.log",
                   ["0"], procs)
        b = _start(folder, _env(lib, tmp_path / "tmp", var="two"), tmp_path / "cwd",
                   tmp_path / "b.log", ["0"], procs)
        assert a.wait(timeout=20) == 0 and b.wait(timeout=20) == 0
        assert a.key != b.key
        assert sorted(p.name for p in folder.glob("*.pid")) == sorted(
            [f"{a.key}.pid", f"{b.key}.pid"])
        out_a, out_b = _report(tmp_path / "a.log"), _report(tmp_path / "b.log")
        assert out_a["var"] == out_a["import_var"] == "one"
        assert out_b["var"] == out_b["import_var"] == "two"  # its launcher imported with it
        assert out_a["imported_pid"] == _launcher_pid(folder, a.key)
        assert out_b["imported_pid"] == _launcher_pid(folder, b.key)
        assert out_a["imported_pid"] != out_b["imported_pid"]


def test_tmpdir_is_per_start_not_per_launcher(lib: Path, tmp_path: Path) -> None:
    env1, env2 = _env(lib, tmp_path / "t1"), _env(lib, tmp_path / "t2")
    assert launcher_key(PY, MODULE, env1) == launcher_key(PY, MODULE, env2)
    assert launcher_key(PY, MODULE, env1) == launcher_key(
        PY, MODULE, {**env1, DIR_ENV: "/somewhere/else"})
    assert launcher_key(PY, MODULE, env1) != launcher_key(PY, "atl_pkg.other", env1)
    assert launcher_key(PY, MODULE, env1) != launcher_key("/usr/bin/python3", MODULE, env1)
    with _scope() as (folder, procs, _):
        one = _start(folder, env1, tmp_path / "cwd", tmp_path / "1.log", ["0"], procs)
        two = _start(folder, env2, tmp_path / "cwd", tmp_path / "2.log", ["0"], procs)
        assert one.wait(timeout=20) == 0 and two.wait(timeout=20) == 0
        assert one.key == two.key
        assert len(list(folder.glob("*.pid"))) == 1
        out1, out2 = _report(tmp_path / "1.log"), _report(tmp_path / "2.log")
        assert out1["imported_pid"] == out2["imported_pid"]
        # the launcher imported with its own TMPDIR (the scope's folder), cached by tempfile
        assert Path(out1["import_tmp"]).resolve() == folder.resolve()
        for out, tmp in ((out1, tmp_path / "t1"), (out2, tmp_path / "t2")):
            assert out["tmpdir"] == str(tmp)
            assert Path(out["gettempdir"]).resolve() == tmp.resolve()


def test_failed_import_returns_none(lib: Path, tmp_path: Path) -> None:
    with _scope() as (folder, procs, _):
        env = _env(lib, tmp_path / "tmp")
        t0 = time.monotonic()
        assert launch(folder, PY, "atl_pkg.bad", ["0"], env, str(tmp_path), tmp_path / "b.log",
                      ready_timeout_s=20.0) is None
        assert launch(folder, PY, "atl_pkg.missing", ["0"], env, str(tmp_path),
                      tmp_path / "m.log", ready_timeout_s=20.0) is None
        assert time.monotonic() - t0 < 15  # the launcher's death is noticed, not waited out
        key = launcher_key(PY, "atl_pkg.bad", env)
        assert "atl_pkg.bad fails to import" in (folder / f"{key}.log").read_text()
        # an interpreter that is not there
        assert launch(folder, str(tmp_path / "no-python"), MODULE, ["0"], env, str(tmp_path),
                      tmp_path / "n.log", ready_timeout_s=20.0) is None
        # a scope folder that is gone
        assert launch(tmp_path / "gone", PY, MODULE, ["0"], env, str(tmp_path),
                      tmp_path / "g.log", ready_timeout_s=20.0) is None
        # the good module still launches in the same scope
        ok = _start(folder, env, tmp_path / "cwd", tmp_path / "ok.log", ["5"], procs)
        assert ok.wait(timeout=20) == 5


def test_killed_process_group_is_an_exit(lib: Path, tmp_path: Path) -> None:
    with _scope() as (folder, procs, _):
        log = tmp_path / "s.log"
        proc = _start(folder, _env(lib, tmp_path / "tmp"), tmp_path / "cwd", log,
                      ["0", "sleep"], procs)
        _until(lambda: log.exists() and "ready" in log.read_text(), 20.0, "the child")
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        assert os.getpgid(proc.pid) == proc.pid  # a session (and process group) of its own
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=10)
        assert code == -signal.SIGTERM
        assert proc.poll() == code and proc.returncode == code
        time.sleep(0.1)
        assert proc.poll() == code


def test_client_gone_stops_its_child(lib: Path, tmp_path: Path) -> None:
    """A client that dies with its connection open takes its server's process group."""
    with _scope() as (folder, _, _):
        env = _env(lib, tmp_path / "tmp")
        log = tmp_path / "c.log"
        (tmp_path / "cwd").mkdir()
        client = textwrap.dedent(f"""
            import os, time
            from pathlib import Path
            from autotune.engine._launcher import launch
            p = launch(Path({str(folder)!r}), {PY!r}, {MODULE!r}, ["0", "sleep"], {env!r},
                       {str(tmp_path / "cwd")!r}, Path({str(log)!r}), ready_timeout_s=20.0)
            print(p.pid if p else "none", flush=True)
            # once the child runs in its own session (launch() may return before it has
            # called setsid: a client that dies sooner leaves its child running)
            for _ in range(400):
                if Path({str(log)!r}).exists() and "ready" in Path({str(log)!r}).read_text():
                    break
                time.sleep(0.05)
            os._exit(0)
        """)
        res = subprocess.run([PY, "-c", client], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
        assert res.returncode == 0, res.stderr
        pid = int(res.stdout.strip())
        try:
            _until(lambda: not _alive(pid), 5.0, "the orphaned child to be stopped")
        finally:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


def test_scope_lifecycle(lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert scope_dir() is None
    with preload_scope(False) as off:
        assert off is None and DIR_ENV not in os.environ
    procs: list[LaunchedProcess] = []
    launchers: list[int] = []
    try:
        with preload_scope() as folder:
            assert folder is not None and folder.is_dir()
            assert folder.name.startswith(f"{_host()}-{os.getpid()}-")
            assert os.environ[DIR_ENV] == str(folder) and scope_dir() == folder
            with preload_scope() as inner:
                assert inner is None
            assert os.environ[DIR_ENV] == str(folder) and folder.is_dir()  # nested: no change
            for var in ("one", "two"):
                _start(folder, _env(lib, tmp_path / "tmp", var=var), tmp_path / "cwd",
                       tmp_path / f"{var}.log", ["0"], procs)
            assert [p.wait(timeout=20) for p in procs] == [0, 0]
            launchers = [int(p.read_text()) for p in folder.glob("*.pid")]
            assert len(launchers) == 2 and all(_alive(pid) for pid in launchers)
        assert DIR_ENV not in os.environ and scope_dir() is None
        assert not folder.exists()
        for pid in launchers:
            _until(lambda pid=pid: not _alive(pid), 5.0, f"launcher {pid} to stop")
    finally:
        _kill(procs)
        for pid in launchers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    # a killed tuner's folder (its owner gone) is swept when the next scope opens; one of
    # a live owner, of another host or without an owner in its name is left alone
    root = folder.parent
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = root / f"{_host()}-{dead.pid}-dead"
    live = root / f"{_host()}-{os.getpid()}-live"
    foreign = root / f"otherhost-{dead.pid}-away"
    for d in (stale, live, foreign):
        d.mkdir()
        (d / "x.log").write_text("")
    try:
        with preload_scope():
            assert not stale.exists() and live.is_dir() and foreign.is_dir()
    finally:
        for d in (live, foreign):
            shutil.rmtree(d, ignore_errors=True)
    # a folder of another host (or a name without an owner) is not this process's to use
    other = tmp_path / "otherhost-1-abcd"
    other.mkdir()
    monkeypatch.setenv(DIR_ENV, str(other))
    assert scope_dir() is None
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "noowner"))
    assert scope_dir() is None


def test_launcher_exits_with_its_owner(lib: Path, tmp_path: Path, short_dir: Path) -> None:
    owner = subprocess.Popen(["sleep", "60"])
    procs: list[LaunchedProcess] = []
    try:
        folder = short_dir / f"{_host()}-{owner.pid}-test"
        folder.mkdir()
        env = _env(lib, tmp_path / "tmp")
        proc = _start(folder, env, tmp_path / "cwd", tmp_path / "o.log", ["0"], procs)
        assert proc.wait(timeout=20) == 0
        launcher = _launcher_pid(folder, proc.key)
        time.sleep(1.2)  # a launcher polls its owner about once a second
        assert _alive(launcher)  # still needed while its owner lives
        owner.kill()
        owner.wait()
        _until(lambda: not _alive(launcher), 5.0, "the launcher to exit with its owner")
        # it cleans up after itself
        _until(lambda: not (folder / f"{proc.key}.pid").exists(), 2.0, "its pid file")
        assert not (folder / f"{proc.key}.sock").exists()
    finally:
        _kill(procs)
        owner.kill()
        owner.wait()


def test_import_edits_to_the_environment_stay(lib: Path, tmp_path: Path) -> None:
    """What the module's import set in os.environ (vLLM's env_override sets
    TRITON_CACHE_AUTOTUNING, without which every start autotuned its Triton kernels again:
    ~10 s a start on the H200) is in the child's environment, as in a plain start."""
    with _scope() as (folder, procs, _):
        env = _env(lib, tmp_path / "tmp", ATL_DROPPED_AT_IMPORT="x")
        proc = _start(folder, env, tmp_path / "cwd", tmp_path / "o.log", ["0"], procs)
        assert proc.wait(timeout=20) == 0
        out = _report(tmp_path / "o.log")
        assert out["set_at_import"] == "set by the import"
        assert out["dropped_at_import"] is None
        assert out["var"] == "one" and out["tmpdir"] == str(tmp_path / "tmp")


def test_signals_are_a_fresh_interpreters(lib: Path, tmp_path: Path) -> None:
    """The child's signal dispositions are those of a plain ``python -m``: SIGPIPE ignored
    above all (a server whose client hung up then gets EPIPE, not death: with SIGPIPE at
    its default a cancelled request killed the server mid-measurement)."""
    env = _env(lib, tmp_path / "tmp")
    plain = subprocess.run([PY, "-m", MODULE, "0"], env=env, cwd=tmp_path, check=True,
                           capture_output=True, text=True, timeout=60)
    # (SIGINT, SIGHUP and SIGQUIT are left out: a plain start inherits them from however
    # the tuner was started, e.g. ignored under nohup; the child sets them to the defaults)
    shown = ("SIGPIPE", "SIGXFSZ", "SIGTERM", "SIGCHLD")
    plain_signals = json.loads(plain.stdout.splitlines()[0])["signals"]
    expected = {k: plain_signals[k] for k in shown}
    assert expected["SIGPIPE"] == expected["SIGXFSZ"] == "SIG_IGN"
    with _scope() as (folder, procs, _):
        proc = _start(folder, env, tmp_path / "cwd", tmp_path / "o.log", ["0"], procs)
        assert proc.wait(timeout=20) == 0
        child = _report(tmp_path / "o.log")["signals"]
        assert {k: child[k] for k in shown} == expected
        assert child["SIGHUP"] == child["SIGQUIT"] == "SIG_DFL"
        assert child["SIGINT"] == "default_int_handler"
