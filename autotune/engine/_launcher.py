"""Preloaded interpreters: vLLM's API server imported once per study, forked per start.

Each server start used to import vLLM's API server (torch, inductor, FastAPI...) anew:
18-21 s of a ~47-s start on the H200 machine, 14 s on 2 CPU cores
(experiments/h200-trust/results-c32-half/importtime.txt). A *launcher* is a detached
Python process that imports the module once and then forks one child per server start;
the child sets the server's argv, working directory and log, and runs the module as
``__main__``, as ``python -m`` would. vLLM forks its own engine process from that same
imported state (``VLLM_WORKER_MULTIPROC_METHOD=fork``), so the fork is as safe as vLLM's.

What makes a forked start the same as a fresh one: a launcher is keyed by the server's
whole environment (less ``TMPDIR``, set per server) and interpreter, so a variable read
while importing (``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS`` read by libgomp as torch
loads, vLLM's logging settings...) always has the server's own value; configs whose
environments differ get launchers of their own. Launchers live in a scope a tuner opens
(:func:`preload_scope`, ``autotune tune --no-preload`` to turn off); trials find them
through ``AUTOTUNE_PRELOAD_DIR`` (Ray workers inherit it), start one on first use, and
fall back to a plain start whenever a launcher cannot be had. A launcher exits with its
scope's owner, or after 30 idle minutes.

Protocol (Unix socket, one connection per server): the client sends one JSON line
``{"argv", "env", "cwd", "log"}``; the launcher answers ``{"pid": N}`` and, when the
child exits, ``{"exit": code}``. A connection closed while its child runs (the client
died) stops the child's process group.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

DIR_ENV = "AUTOTUNE_PRELOAD_DIR"  # the scope's folder (set by preload_scope)
IDLE_EXIT_S = 1800.0
_READY_TIMEOUT_S = 300.0  # a launcher's import (the first start waits for it)


def launcher_key(python: str, module: str, env: Mapping[str, str]) -> str:
    """The launcher that can start a server: same interpreter, module and environment
    (``TMPDIR`` aside)."""
    items = sorted((k, v) for k, v in env.items() if k not in ("TMPDIR", DIR_ENV))
    blob = json.dumps([python, module, items], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _owner_of(folder: Path) -> tuple[str, int] | None:
    """(host, pid) from a scope folder's name ``<host>-<pid>-<token>``."""
    parts = folder.name.rsplit("-", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def scope_dir() -> Path | None:
    """The open scope's folder when this process may use it (same host), else None."""
    value = os.environ.get(DIR_ENV)
    if not value:
        return None
    folder = Path(value)
    owner = _owner_of(folder)
    if owner is None or owner[0] != _host() or not folder.is_dir():
        return None
    return folder


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


@contextlib.contextmanager
def preload_scope(enabled: bool = True) -> Iterator[Path | None]:
    """Open a scope for launchers (this process owns them) for the ``with`` block: servers
    started inside it, by this process or by Ray workers started after it opened, fork
    from them. At the end every launcher of the scope is stopped and its folder removed.
    Nested scopes and ``enabled=False`` yield None and change nothing."""
    if not enabled or os.environ.get(DIR_ENV):
        yield None
        return
    # Unix socket paths are short (108 bytes): a short folder under the system's tmp
    root = Path(tempfile.gettempdir()) / f"autotune-pre-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    _sweep(root)
    # a token of its own: a scope after another in this process never meets the first's
    # launchers (they may still be exiting)
    folder = root / f"{_host()}-{os.getpid()}-{secrets.token_hex(4)}"
    folder.mkdir(mode=0o700)
    os.environ[DIR_ENV] = str(folder)
    try:
        yield folder
    finally:
        os.environ.pop(DIR_ENV, None)
        stop_launchers(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _sweep(root: Path) -> None:
    """Remove the scope folders of this host whose owner is gone (a tuner killed with
    SIGKILL never closes its scope), after stopping any launcher still in them."""
    for folder in root.iterdir():
        owner = _owner_of(folder)
        if owner is None or owner[0] != _host() or _alive(owner[1]) or not folder.is_dir():
            continue
        stop_launchers(folder, timeout_s=1.0)
        shutil.rmtree(folder, ignore_errors=True)


def stop_launchers(folder: Path, timeout_s: float = 5.0) -> None:
    """SIGTERM every launcher of a scope and wait for them (their servers are the trials'
    to stop). A pid file whose process is not that launcher any more is left alone."""
    pids = []
    for pid_file in folder.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().strip())
            if _is_launcher(pid, pid_file.stem):
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
    end = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)


def _is_launcher(pid: int, key: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return key.encode() in f.read()
    except OSError:
        return False


class LaunchedProcess:
    """A server forked by a launcher, with the part of :class:`subprocess.Popen` that
    :class:`~autotune.engine.VllmServer` uses: ``pid``, ``poll``, ``wait``,
    ``returncode``. The exit code comes over the launcher's connection; if the launcher
    is gone, the process is watched in /proc (code -1 once it is gone)."""

    def __init__(self, pid: int, conn: socket.socket, key: str, received: bytes = b"") -> None:
        self.pid, self.key = pid, key
        self.returncode: int | None = None
        self._conn: socket.socket | None = conn
        self._buf = received  # what came after the pid's line (a quick exit's message)
        conn.setblocking(False)

    def _read(self) -> None:
        while self._conn is not None:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    if "exit" in msg:
                        self.returncode = int(msg["exit"])
            if self.returncode is not None:
                return
            try:
                chunk = self._conn.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:  # the launcher is gone: watch the process itself
                self._close()
                return
            self._buf += chunk

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read()
        if self.returncode is None and self._conn is None and not _alive(self.pid):
            self.returncode = -1
        if self.returncode is not None:
            self._close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def launch(folder: Path, python: str, module: str, args: Sequence[str],
           env: Mapping[str, str], cwd: str, log_path: Path,
           ready_timeout_s: float = _READY_TIMEOUT_S) -> LaunchedProcess | None:
    """Start ``python -m module *args`` from the scope's launcher for this environment,
    starting the launcher first if there is none (its import is then waited for). None
    when no launcher could be had (the caller starts the server plainly); never raises."""
    key = launcher_key(python, module, env)
    sock_path = folder / f"{key}.sock"
    try:
        conn = _connect(sock_path)
        if conn is None:
            with open(folder / f"{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one launcher per key, even across workers
                conn = _connect(sock_path)
                if conn is None:
                    pid = _spawn(folder, key, python, module, env)
                    conn = _await(sock_path, pid, ready_timeout_s)
        if conn is None:
            return None
        conn.sendall(json.dumps({"argv": list(args), "env": dict(env), "cwd": cwd,
                                 "log": str(log_path)}).encode() + b"\n")
        conn.settimeout(30.0)
        reply = b""
        while b"\n" not in reply:
            chunk = conn.recv(4096)
            if not chunk:
                raise OSError("the launcher closed the connection")
            reply += chunk
        line, rest = reply.split(b"\n", 1)
        return LaunchedProcess(int(json.loads(line)["pid"]), conn, key, received=rest)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("preloaded interpreter not used (%s); starting vLLM plainly", exc)
        return None


def _connect(path: Path) -> socket.socket | None:
    if not path.exists():
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return s
    except OSError:
        s.close()
        return None


def _await(path: Path, pid: int, timeout_s: float) -> socket.socket | None:
    """Wait for a new launcher's socket (it binds after its import)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        conn = _connect(path)
        if conn is not None:
            return conn
        if not _alive(pid):
            logger.warning("the preloaded interpreter exited during its import (see %s)",
                           path.with_suffix(".log"))
            return None
        time.sleep(0.1)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGTERM)
    return None


def _spawn(folder: Path, key: str, python: str, module: str, env: Mapping[str, str]) -> int:
    """Start a detached launcher; returns its pid (it writes ``<key>.pid`` itself)."""
    owner = _owner_of(folder)
    child_env = {k: v for k, v in env.items() if k != DIR_ENV}
    child_env["TMPDIR"] = str(folder)
    child_env["PYTHONUNBUFFERED"] = "1"
    with contextlib.suppress(OSError):
        (folder / f"{key}.pid").unlink()  # a launcher that failed before: not this one
    log = open(folder / f"{key}.log", "ab", buffering=0)
    try:
        proc = subprocess.Popen(
            [python, "-c", _LAUNCHER, str(folder), key, module, str(owner[1] if owner else 0),
             str(IDLE_EXIT_S)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env,
            cwd=str(folder), start_new_session=True)
    finally:
        log.close()
    proc.wait()  # the first process forks the launcher and exits (detached from us)
    pid_file = folder / f"{key}.pid"
    end = time.monotonic() + 10.0
    while time.monotonic() < end:
        with contextlib.suppress(OSError, ValueError):
            return int(pid_file.read_text().strip())
        time.sleep(0.02)
    raise OSError(f"the launcher did not start (see {folder / (key + '.log')})")


# The launcher. argv: folder, key, module, owner pid (0: none), idle exit seconds.
_LAUNCHER = r'''
import json, os, select, signal, socket, sys, time, traceback
folder, key, module = sys.argv[1], sys.argv[2], sys.argv[3]
owner, idle_s = int(sys.argv[4]), float(sys.argv[5])
if os.fork():
    os._exit(0)
pid_path = os.path.join(folder, key + ".pid")
with open(pid_path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_path + ".tmp", pid_path)
t0 = time.monotonic()
base_env = dict(os.environ)  # what the servers' env is compared with (vLLM's import edits it)
import importlib
importlib.import_module(module)
import threading
print(f"autotune launcher {key}: imported {module} in {time.monotonic() - t0:.1f} s "
      f"({threading.active_count()} thread(s))", flush=True)
sock_path = os.path.join(folder, key + ".sock")
tmp_path = sock_path + ".%d" % os.getpid()
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(tmp_path)
srv.listen(16)
os.replace(tmp_path, sock_path)  # clients connect only once the import is done
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
children = {}  # pid -> connection
last_use = time.monotonic()


def child(req, conn, ready_w):
    code = 1
    try:
        # the dispositions of a fresh interpreter: SIGPIPE and SIGXFSZ ignored (a write to
        # a client that hung up is an EPIPE, not the server's death), SIGINT a
        # KeyboardInterrupt, the rest at their defaults
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT):
            signal.signal(s, signal.SIG_DFL)
        for s in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        os.write(ready_w, b"1")  # the process group exists: the client may be told the pid
        os.close(ready_w)
        srv.close()
        conn.close()
        for c in children.values():
            c.close()
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        # the server's environment: this one as the import left it (vLLM sets a few
        # variables then, e.g. TRITON_CACHE_AUTOTUNING), with what the request changes
        for k in set(base_env) | set(req["env"]):
            if req["env"].get(k) != base_env.get(k):
                if k in req["env"]:
                    os.environ[k] = req["env"][k]
                else:
                    os.environ.pop(k, None)
        import tempfile, runpy
        tempfile.tempdir = None
        sys.path[0] = req["cwd"]
        sys.argv = [""] + list(req["argv"])
        sys.modules.pop(module, None)  # run it afresh as __main__, as python -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            import threading, atexit
            threading._shutdown()
            atexit._run_exitfuncs()
        except BaseException:
            pass
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException:
                pass
        os._exit(code)


def send(conn, msg):
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:
        pass


while not stop:
    try:
        ready, _, _ = select.select([srv, *children.values()], [], [], 0.2)
    except InterruptedError:
        ready = []
    for r in ready:
        if r is srv:
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.settimeout(30.0)
            try:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        raise OSError("closed")
                    data += chunk
                req = json.loads(data)
            except (OSError, ValueError):
                conn.close()
                continue
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(ready_r)
                child(req, conn, ready_w)
            os.close(ready_w)
            select.select([ready_r], [], [], 10.0)
            os.close(ready_r)
            children[pid] = conn
            last_use = time.monotonic()
            send(conn, {"pid": pid})
        else:  # a client closed its connection: if its child still runs, the client died
            try:
                gone = r.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                gone = True
            if gone:
                for pid, c in list(children.items()):
                    if c is r:
                        try:
                            os.killpg(pid, signal.SIGTERM)
                        except OSError:
                            pass
                        children[pid] = None
                r.close()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        conn = children.pop(pid, None)
        if conn is not None:
            send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()
        last_use = time.monotonic()
    children = {p: c for p, c in children.items() if c is not None}
    if owner and not os.path.exists(f"/proc/{owner}"):
        break
    if not children and time.monotonic() - last_use > idle_s:
        break
srv.close()
for p in (sock_path, pid_path):
    try:
        os.unlink(p)
    except OSError:
        pass
'''
