"""The vLLM launcher: failure classes provoked for real on the CPU build, clean stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.engine import (
    FailureReason,
    VllmServer,
    free_port,
)
from autotune.errors import EngineCrashedError, EngineStartError
from tests.conftest import needs_vllm


def _our_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines() if marker in ln and "ps -eo" not in ln]


@needs_vllm
@pytest.mark.slow
def test_invalid_flag_is_invalid_config(tiny_llama: Path, tmp_path: Path) -> None:
    s = VllmServer(model=str(tiny_llama), flags=["--max-num-seqs", "lots"], log_path=tmp_path / "l.log")
    s.start()
    with pytest.raises(EngineStartError) as err:
        s.wait_healthy(300)
    s.stop()
    assert err.value.reason == FailureReason.INVALID_CONFIG
    assert "--max-num-seqs" in (tmp_path / "l.log").read_text()


@needs_vllm
@pytest.mark.slow
def test_contradictory_flags_are_invalid_config(tiny_llama: Path, tmp_path: Path) -> None:
    s = VllmServer(model=str(tiny_llama), log_path=tmp_path / "l.log",
                   flags=["--max-num-seqs", "64", "--max-num-batched-tokens", "16", "-O0"])
    s.start()
    with pytest.raises(EngineStartError) as err:
        s.wait_healthy(300)
    s.stop()
    assert err.value.reason == FailureReason.INVALID_CONFIG, err.value.log_tail[-2000:]


@needs_vllm
@pytest.mark.slow
def test_start_timeout_stops_the_server(tiny_llama: Path, tmp_path: Path) -> None:
    s = VllmServer(model=str(tiny_llama), log_path=tmp_path / "l.log", flags=["-O0"])
    s.start()
    pid = s.pid
    with pytest.raises(EngineStartError) as err:
        s.wait_healthy(3)
    assert err.value.reason == FailureReason.START_TIMEOUT
    assert "start_timeout" in str(err.value)
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone


@needs_vllm
@pytest.mark.slow
@pytest.mark.kills_shared_server
def test_killed_server_is_detected_and_group_reaped(tiny_server: VllmServer) -> None:
    """SIGKILL the shared server's API server (this test runs last): check_alive says died,
    stop() reaps the rest of its group (engine core, worker)."""
    s = tiny_server
    s.check_alive()
    os.kill(s.pid, signal.SIGKILL)  # type: ignore[arg-type]
    time.sleep(1.0)
    with pytest.raises(EngineCrashedError) as err:
        s.check_alive()
    assert err.value.reason in (FailureReason.DIED, FailureReason.OOM)
    errors = s.stop()
    assert errors == []
    time.sleep(1.0)
    assert _our_processes(f"--port {s.port}") == []


@needs_vllm
@pytest.mark.slow
def test_the_suites_servers_run_no_worker_process(tiny_server: VllmServer) -> None:
    """The shared server (AUTOTUNE_CPU_INPROC_WORKER=1): an API server and an engine core,
    no third process for the model; it serves."""
    text = Path(tiny_server.log_path).read_text(errors="replace")  # type: ignore[arg-type]
    assert "(EngineCore" in text and "(VllmWorker" not in text, text[-3000:]
    tiny_server.check_serving()
    # autotune asks for a forked engine process (the CPU build spawns it anyway; vLLM on a
    # GPU forks it: experiments/h200-trust/results-start-method/)
    environ = Path(f"/proc/{tiny_server.pid}/environ").read_bytes().split(b"\0")
    assert b"VLLM_WORKER_MULTIPROC_METHOD=fork" in environ


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_python_without_vllm_is_a_clear_start_error(tmp_path: Path) -> None:
    # A python that cannot import vLLM: the server exits at once, with a reason.
    s = VllmServer(model=str(tmp_path), python=sys.executable, log_path=tmp_path / "l.log",
                   flags=["--definitely-not-a-flag"])
    s.command = lambda: [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]  # type: ignore[method-assign]
    s.start()
    with pytest.raises(EngineStartError) as err:
        s.wait_healthy(30)
    s.stop()
    assert err.value.reason == FailureReason.CRASH
    assert "code 3" in str(err.value)


