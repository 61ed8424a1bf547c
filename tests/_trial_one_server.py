"""Helpers shared by tests/integration/test_trial_one_server.py and tests/unit/test_trial_one_server.py."""

from __future__ import annotations

from pathlib import Path

from autotune.traffic import LoadSpec, constant_shape
from autotune.trial import TrialSpec
from tests._specs import flat_spec
from tests.faults._lab import FAKE_VLLM

OPEN = constant_shape(32, 16, name="open-16", load=LoadSpec(mode="open", rate_rps=40.0,
                                                           requests=16))


def _fake(tmp: Path, plan: str, shape: object = OPEN, number: int = 0, **kw: object) -> TrialSpec:
    """A trial on the fake engine; every spec of one test shares its server fields. Short
    caps (2 s of warm-up, 2 s of measurement): an open loop is sized by time, and these
    tests are about which trial fails, not about precision."""
    kw = {"precision": 0.2, "warmup_max_s": 2, "measure_max_s": 2, **kw}
    return flat_spec(
        number=number, model=str(tmp / "model"), flags=("--max-model-len", "1024"),
        env={"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": plan,
             "AUTOTUNE_FAKE_CHUNK_S": "0.002", "AUTOTUNE_FAKE_COUNTER": str(tmp / "launches")},
        shape=shape, warmup_requests=4, start_timeout_s=30, log_path=str(tmp / "server.log"),
        **kw,
    )  # fmt: skip
