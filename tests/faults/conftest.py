"""Fixtures of the fault-injection suite (the helpers and how faults are made: _lab.py)."""

from __future__ import annotations

import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults._lab import Lab, kill_tagged, memory_cgroup_root

# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def tag(request: pytest.FixtureRequest) -> Iterator[str]:
    """A tag unique to this test; whatever still carries it at teardown is killed."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40]
    t = f"atf-{name}-{uuid.uuid4().hex[:8]}"
    yield t
    left = kill_tagged(t)
    if left:
        sys.stderr.write(f"fault suite: killed leftovers of {t}: {[str(p) for p in left]}\n")


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite MLflow store for the session (creating its tables costs seconds)."""
    from autotune.results import MlflowTracker

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowTracker(uri, experiment="fault-suite")
    return uri


@pytest.fixture
def lab(tmp_path: Path, tag: str, fake_model: Path, mlflow_uri: str) -> Lab:
    return Lab(root=tmp_path, tag=tag, model=fake_model, mlflow_uri=mlflow_uri)


@pytest.fixture
def memory_cgroup() -> Iterator[Callable[[int], Path]]:
    """Make a child memory cgroup with a limit in bytes (skips where that is not allowed).
    A process that writes its pid into ``<cgroup>/cgroup.procs`` and then uses more memory
    is killed by the kernel's OOM killer: a real out-of-memory, not a simulation."""
    made: list[Path] = []

    def make(limit_bytes: int) -> Path:
        found = memory_cgroup_root()
        if found is None:
            pytest.skip("no memory cgroup controller here")
        root, limit_file = found
        cg = root / f"autotune-faults-{uuid.uuid4().hex[:8]}"
        try:
            cg.mkdir()
            (cg / limit_file).write_text(str(limit_bytes))
        except OSError as exc:
            pytest.skip(f"cannot create a memory cgroup under {root}: {exc}")
        made.append(cg)
        return cg

    yield make
    for cg in made:
        deadline = time.monotonic() + 10
        while True:
            try:
                cg.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
