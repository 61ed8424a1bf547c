"""A trial whose requests mostly fail stops early and says why (the fault suite's fake
engine answers HTTP 500 to every request; nothing is mocked in the trial)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from autotune.traffic import LoadSpec, constant_shape

FAKE_VLLM = (Path(__file__).parents[1] / "faults" / "fake_vllm").resolve()


def test_trial_stops_once_most_requests_fail(tmp_path: Path) -> None:
    from autotune.trial import run_trial
    from tests._specs import flat_spec

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1000,
                                                   "max_position_embeddings": 2048}))
    shape = constant_shape(32, 8, name="c", load=LoadSpec(mode="closed", concurrency=2,
                                                         requests=400))
    spec = flat_spec(number=0, model=str(model), flags=("--max-model-len", "1024"),
                      env={"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": "fail:1"},
                      shape=shape, warmup_requests=0, start_timeout_s=60,
                      log_dir=str(tmp_path))
    t0 = time.monotonic()
    out = run_trial(spec)
    assert not out.ok and out.reason == "aborted", out.message
    assert "\n" not in out.message and "http_5xx" in out.message and "server log" in out.message
    assert re.search(r"stopped after (\d+) of \1 requests failed", out.message), out.message
    assert time.monotonic() - t0 < 60
