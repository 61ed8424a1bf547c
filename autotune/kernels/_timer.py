"""The driver's end of a GPU worker: a :class:`KernelTimer` that talks to
``python -m autotune.kernels._worker`` on one GPU (``CUDA_VISIBLE_DEVICES``).

A worker that dies or hangs costs one candidate (reason ``crash`` or ``timeout``) and is
started again for the next one; its stderr goes to a log file beside the results. A
timing gets ``call_timeout_s`` (300 s), cut to what is left of a kernel budget
(``deadline``) but never below ``min_call_timeout_s`` (30 s: a Triton compile and a long
re-check fit in it), so a hung config ends the tuning close to its budget.

:func:`start_workers` starts the workers of several GPUs at once (each loads torch, vLLM
and its tensors: about 20 s on an H200) and waits for every greeting.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, TypedDict

from autotune.errors import AutotuneError
from autotune.kernels._moe_shape import MoeShape
from autotune.kernels._search import KernelFailure
from autotune.kernels._worker import Answer

__all__ = ["TimerOptions", "WorkerTimer", "start_workers"]

logger = logging.getLogger(__name__)


class TimerOptions(TypedDict, total=False):
    """The optional settings of :class:`WorkerTimer` (its keyword arguments)."""

    python: str
    call_timeout_s: float
    start_timeout_s: float
    min_call_timeout_s: float
    min_start_timeout_s: float


class WorkerTimer:
    """Times configs in a worker process on GPU ``gpu``; restarts it after a crash."""

    def __init__(self, shape: MoeShape, *, gpu: int, log_path: Path | None = None,
                 python: str = sys.executable, seed: int = 0,
                 call_timeout_s: float = 300.0, start_timeout_s: float = 600.0,
                 deadline: float | None = None, min_call_timeout_s: float = 30.0,
                 min_start_timeout_s: float = 60.0) -> None:
        self.shape = shape
        self.gpu = gpu
        self.log_path = log_path
        self.python = python
        self.seed = seed
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self.deadline = deadline  # a time.monotonic(): the kernel budget's end
        self.min_call_timeout_s = min_call_timeout_s
        self.min_start_timeout_s = min_start_timeout_s  # a restart's floor, with a deadline
        self.hello: Answer | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        self._launched = 0.0
        self.restarts = 0

    # -- process ---------------------------------------------------------------------------
    def start(self) -> Answer:
        """Start the worker and return its greeting (GPU name, vLLM's file name, versions).

        Raises :class:`AutotuneError` when the worker cannot time anything at all."""
        self.launch()
        return self.ready()

    def launch(self) -> None:
        """Start the worker process and send it the MoE shape; :meth:`ready` waits for it."""
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(self.gpu), PYTHONUNBUFFERED="1")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "a", encoding="utf-8")
        try:
            self._proc = subprocess.Popen(
                [self.python, "-m", "autotune.kernels._worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._log or subprocess.DEVNULL, text=True,
                env=env, start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            self.close()
            raise AutotuneError(
                f"the kernel worker on GPU {self.gpu} could not start ({self.python}: {exc}); "
                "it needs the CUDA build of vLLM and a GPU") from exc
        self._launched = time.monotonic()
        shape = {**asdict(self.shape), "activation": self.shape.activation}
        try:
            self._send({"shape": shape, "seed": self.seed})
        except OSError:
            pass  # it exited already: ready() says so

    def ready(self, timeout_s: float | None = None) -> Answer:
        """The greeting of the worker :meth:`launch` started, within ``timeout_s`` (default
        ``start_timeout_s``) of its launch; raises :class:`AutotuneError` (and stops it)
        when none comes."""
        limit = self.start_timeout_s if timeout_s is None else timeout_s
        answer = self._receive(self._launched + limit - time.monotonic())
        if isinstance(answer, str) or not answer.get("ok"):
            if isinstance(answer, str):
                why = "it exited" if answer == "crash" else f"no answer within {limit:.3g} s"
            else:
                why = str(answer.get("message") or "it refused")
            self.close(kill=True)
            raise AutotuneError(
                f"the kernel worker on GPU {self.gpu} could not start ({why}); see "
                f"{self.log_path or 'its stderr'}; it needs the CUDA build of vLLM and a GPU")
        self.hello = answer
        return answer

    def close(self, *, kill: bool = False) -> None:
        """Stop the worker: end of input, then SIGKILL of its group (at once with ``kill``)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                if proc.stdin:
                    proc.stdin.close()
                proc.wait(timeout=0.1 if kill else 10)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _send(self, obj: Mapping[str, object]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(obj) + "\n")
        self._proc.stdin.flush()

    def _receive(self, timeout_s: float) -> Answer | str:
        """The worker's next answer, or "crash" (it exited) or "timeout" (no answer)."""
        assert self._proc is not None and self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:  # one look even with no time left: an answer may be waiting
            wait = max(0.0, min(1.0, deadline - time.monotonic()))
            ready, _, _ = select.select([self._proc.stdout], [], [], wait)
            if ready:
                line = self._proc.stdout.readline()
                if not line:
                    return "crash"  # end of its output: the worker exited
                answer: Answer = json.loads(line)
                return answer
            if self._proc.poll() is not None:
                return "crash"
            if time.monotonic() >= deadline:
                return "timeout"

    def restart_timeout(self) -> float:
        """Seconds a restarted worker may take to greet: ``start_timeout_s``, cut to the
        budget's time left, never below ``min_start_timeout_s`` (a worker starts in ~20 s
        on an H200; a restart that hangs must not outlast the budget by 10 minutes)."""
        if self.deadline is None:
            return self.start_timeout_s
        left = self.deadline - time.monotonic()
        return min(self.start_timeout_s, max(self.min_start_timeout_s, left))

    def call_timeout(self) -> float:
        """Seconds the next timing may take: ``call_timeout_s``, cut to the budget's time
        left, never below ``min_call_timeout_s``."""
        if self.deadline is None:
            return self.call_timeout_s
        left = self.deadline - time.monotonic()
        return min(self.call_timeout_s, max(self.min_call_timeout_s, left))

    # -- KernelTimer -----------------------------------------------------------------------
    def __call__(self, config: dict[str, int], m: int, *, iters: int) -> float:
        if self._proc is None or self._proc.poll() is not None:
            if self.hello is not None:
                self.restarts += 1
            self.close()
            self.launch()
            self.ready(self.restart_timeout())
        try:
            self._send({"m": m, "config": config, "iters": iters})
        except (BrokenPipeError, OSError) as exc:
            self.close()
            raise KernelFailure("crash", f"the worker went away: {exc}") from exc
        timeout = self.call_timeout()
        answer = self._receive(timeout)
        if isinstance(answer, str):
            code = None if self._proc is None else self._proc.poll()
            self.close(kill=True)
            if answer == "timeout":
                cut = " (the kernel budget's time left)" if timeout < self.call_timeout_s else ""
                raise KernelFailure("timeout", f"no answer within {timeout:.0f} s{cut}")
            raise KernelFailure("crash", f"the worker exited (code {code})")
        if not answer.get("ok"):
            raise KernelFailure(str(answer.get("reason", "error")), str(answer.get("message", "")))
        return float(answer["us"])


def start_workers(timers: Sequence[WorkerTimer]) -> list[Answer]:
    """Start every worker at once and wait for all their greetings (in ``timers``' order).

    When one cannot start, all are stopped and an :class:`AutotuneError` names each that
    failed (one line), as :meth:`WorkerTimer.start` does for one."""
    errors: list[AutotuneError] = []
    hellos: list[Answer] = []
    try:
        for w in timers:
            w.launch()
        for w in timers:
            try:
                hellos.append(w.ready())
            except AutotuneError as exc:  # the others are still waited for: each is reported
                errors.append(exc)
    except BaseException:
        for w in timers:
            w.close(kill=True)
        raise
    if errors:
        for w in timers:
            w.close(kill=True)
        if len(errors) == 1:
            raise errors[0]
        raise AutotuneError("; ".join(map(str, errors))) from errors[0]
    return hellos
