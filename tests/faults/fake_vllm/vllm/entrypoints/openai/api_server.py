"""A fake ``python -m vllm.entrypoints.openai.api_server`` for the fault-injection suite.

Put ``tests/faults/fake_vllm`` on the *server's* ``PYTHONPATH`` (a search space's
``fixed_env``, a ``TrialSpec.env`` or ``VllmServer(env=...)``) and the library launches this
instead of vLLM, with the very same argv, process group, parent-death signal, log file and
stop sequence. It serves autotune's streaming stub (``autotune.testing.stub_server``), or misbehaves
as ``AUTOTUNE_FAKE_PLAN`` says: one mode per launch, comma-separated; launches are counted
in the folder ``AUTOTUNE_FAKE_COUNTER`` (the last mode repeats; without a counter the
first mode is used).

Modes (``name`` or ``name:N``):

==============  ==========================================================================
``ok``          serve normally
``exit``        print a Python error during start and exit with code 1
``reject``      refuse the flags as vLLM's argument parser does (exit code 2)
``hang``        never listen (``/health`` never answers); a child process in the group
                stands for vLLM's EngineCore and exits when the leader dies
``stubborn``    like ``hang``, but the leader ignores SIGTERM (a wedged server)
``oom``         join the memory cgroup ``AUTOTUNE_FAKE_CGROUP`` and allocate until the
                kernel's OOM killer sends SIGKILL (a real out-of-memory at start)
``die:N``       serve; SIGKILL itself when request N arrives (mid-measurement death)
``fail:K``      serve; every K-th request answers HTTP 500
``dead:N``      serve; at request N the "engine" dies behind the live API server: it logs
                a worker's IndexError and vLLM's EngineDeadError, and from then on every
                request and ``/health`` answer HTTP 500 (the process stays up)
``stall:N``     serve; request N goes silent after two chunks for ``AUTOTUNE_FAKE_STALL_S``
``slow``        serve; chunks ``AUTOTUNE_FAKE_CHUNK_S`` apart (a trial that takes a while)
``jit:N``       like ``slow``; requests 1..N each log vLLM's kernel-JIT warning ("Triton
                kernel JIT compilation during inference: ...") as a GPU vLLM does when
                the traffic reaches a batch shape its warm-up did not cover
``chatty:KB``   write KB kilobytes of log lines, then serve
``real``        become the real vLLM: exec ``python -m vllm.entrypoints.openai.api_server``
                with the same argv, pid, process group and parent-death signal
==============  ==========================================================================

``AUTOTUNE_FAKE_MAX_RUNNING=N`` (or ``max-num-seqs``: the launch's ``--max-num-seqs``, 2
without it) gives a serving fake a known capacity: N streams at once, chunks
``AUTOTUNE_FAKE_CHUNK_S`` apart, the rest queued (``--objective capacity`` tests).

Every request is announced on stdout (``fake-vllm: request N``), so a test can see from the
trial's server log that the measurement has started. A taken port fails like vLLM does
(``OSError: [Errno 98] Address already in use``).
"""

from __future__ import annotations

import argparse
import errno
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _launch_index() -> int:
    folder = os.environ.get("AUTOTUNE_FAKE_COUNTER")
    if not folder:
        return 0
    Path(folder).mkdir(parents=True, exist_ok=True)
    for i in itertools.count():
        try:  # O_EXCL makes the count exact even if two servers start at once
            os.close(os.open(Path(folder) / f"launch-{i:04d}", os.O_CREAT | os.O_EXCL))
            return i
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _mode() -> tuple[str, int, int]:
    plan = [m.strip() for m in os.environ.get("AUTOTUNE_FAKE_PLAN", "ok").split(",") if m.strip()]
    i = _launch_index()
    name, _, arg = plan[min(i, len(plan) - 1)].partition(":")
    return name, int(arg or 0), i


def _say(text: str) -> None:
    try:
        print(f"fake-vllm: {text}", flush=True)
    except OSError:  # a full disk under the log: keep serving, as vLLM's logging does
        pass


def _engine_core() -> subprocess.Popen[bytes]:
    # Like vLLM's EngineCore: a second process of the group that ends when its parent does
    # (it reads its stdin, a pipe whose only writer is the leader).
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.buffer.read()"], stdin=subprocess.PIPE
    )


def _oom() -> None:
    cgroup = os.environ["AUTOTUNE_FAKE_CGROUP"]
    Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    _say(f"loading weights into memory (cgroup {cgroup})")
    hoard = []
    while True:  # touch every page: the kernel has to account for it
        hoard.append(bytearray(16 << 20))


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:  # the text vLLM's uvicorn prints
            print("Traceback (most recent call last):\n"
                  f"OSError: [Errno 98] Address already in use: ('{host}', {port})", flush=True)
            sys.exit(1)
        raise
    sock.listen(512)
    return sock


def _max_running() -> int:
    """``AUTOTUNE_FAKE_MAX_RUNNING=N``: a server with a known capacity (N streams at once, the
    rest queue; chunks ``AUTOTUNE_FAKE_CHUNK_S`` apart), for ``--objective capacity``;
    ``max-num-seqs``: N is the launch's ``--max-num-seqs`` (2 without the flag), so the
    capacity follows the knob a study tunes."""
    value = os.environ.get("AUTOTUNE_FAKE_MAX_RUNNING", "0")
    if value != "max-num-seqs":
        return int(value)
    argv = sys.argv[1:]
    return int(argv[argv.index("--max-num-seqs") + 1]) if "--max-num-seqs" in argv else 2


def _serve(host: str, port: int, model: str, mode: str, arg: int) -> None:
    import asyncio

    import autotune.testing.stub_server as stub

    counter = itertools.count(1)

    def fault_of(req: object) -> str:
        n = next(counter)
        _say(f"request {n}")
        if mode == "die" and n >= arg:
            _say("SIGKILL now")
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "fail" and n % arg == 0:
            return "http_500"
        if mode == "dead" and n >= arg:
            if n == arg:
                print("(Worker pid=1) ERROR [multiproc_executor.py:1063] Traceback (most recent "
                      "call last):\n(Worker pid=1) ERROR [multiproc_executor.py:1063] "
                      "IndexError: index 3 is out of bounds for dimension 0 with size 1\n"
                      "(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions."
                      "EngineDeadError: EngineCore encountered an issue.", flush=True)
                stub._health_status = lambda: 500  # type: ignore[assignment]
            return "http_500"
        if mode == "stall" and n == arg:
            return "stall"
        if mode == "jit" and n <= arg:
            print(f"WARNING [jit_monitor.py:130] Triton kernel JIT compilation during "
                  f"inference: fused_moe_kernel (M={n}). This causes a latency spike; "
                  "consider extending warmup to cover this shape/config.", flush=True)
        return "ok"

    stub._fault_of = fault_of  # type: ignore[assignment]  # pick faults by request number
    max_running = _max_running()
    config = stub.StubConfig(
        model=model,
        stall_s=float(os.environ.get("AUTOTUNE_FAKE_STALL_S", "60")),
        chunk_interval_s=float(os.environ.get("AUTOTUNE_FAKE_CHUNK_S", "0.05"))
        if mode in ("slow", "jit") or max_running else 0.0,
        max_running=max_running,
    )
    sock = _bind(host, port)

    async def main() -> None:
        await stub.start_server(config, sock=sock)
        _say(f"serving {model} on {host}:{port}")
        await asyncio.Event().wait()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--served-model-name", default="autotune-model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args, engine_flags = p.parse_known_args(argv)
    mode, arg, index = _mode()
    _say(f"launch {index} mode {mode}:{arg} pid {os.getpid()} pgid {os.getpgid(0)} "
         f"flags {' '.join(engine_flags)}")
    if mode == "real":
        fake = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d and d != fake)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *sys.argv[1:]]
        os.execve(sys.executable, argv, env)
    if mode == "reject":
        print("usage: api_server.py [-h] [--model MODEL] ...\n"
              "api_server.py: error: argument --max-num-seqs: invalid int value: 'lots'",
              flush=True)
        sys.exit(2)
    if mode == "exit":
        print("Traceback (most recent call last):\n"
              "RuntimeError: Engine core initialization failed. See root cause above.",
              flush=True)
        sys.exit(1)
    if mode in ("hang", "stubborn"):
        if mode == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        core = _engine_core()
        _say(f"engine core pid {core.pid}; loading forever")
        while True:
            time.sleep(3600)
    if mode == "oom":
        _oom()
    if mode == "chatty":
        line = "INFO fake-vllm: " + "x" * 100 + "\n"
        for _ in range(arg * 1024 // len(line) + 1):
            try:
                sys.stdout.write(line)
                sys.stdout.flush()
            except OSError:  # no space left: logging.Handler.handleError goes on too
                pass
    _serve(args.host, args.port, args.served_model_name, mode, arg)


if __name__ == "__main__":
    main()
