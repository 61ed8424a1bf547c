"""Several trials on one server start (``run_trials_on_one_server``): each shape measured in
turn on the server the first one started, failures kept per trial.

The fault suite's fake vLLM (a real server process the library launches exactly as vLLM,
counting its launches) shows what happens when a trial fails or the server dies; the one
real CPU vLLM test measures a closed-loop and an open-loop (capacity) shape on one start.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from autotune.store import FailureReason
from autotune.traffic import LoadSpec, constant_shape, load_shape
from autotune.trial import TrialOutcome, capacity_spec, run_trials_on_one_server
from tests._specs import flat_spec
from tests._trial_one_server import _fake
from tests.conftest import REPO, needs_vllm
from tests.faults._lab import SHAPE


@pytest.fixture
def model_dir(tmp_path: Path, fake_model: Path) -> Path:
    (tmp_path / "model").symlink_to(fake_model)
    return tmp_path


def _launches(tmp: Path) -> int:
    return len(list((tmp / "launches").glob("launch-*")))


def test_shapes_in_turn_on_one_start_each_warmed_up(model_dir: Path) -> None:
    closed = _fake(model_dir, "slow", load_shape(SHAPE), num_requests=16, concurrency=4,
                   segment_requests=8,
                   precision=0.2, warmup_max_s=2, measure_max_s=2)
    cap = _fake(model_dir, "slow", load_shape(SHAPE), number=1, slo={"ttft_p99": 1.0},
                **capacity_spec(goodput=0.9, max_error_rate=0.05, start=4.0, tolerance=0.5,
                                level_s=0.5, max_levels=2))
    heard: list[tuple[int, bool, int]] = []
    phases: list[tuple[int, str]] = []
    outs = run_trials_on_one_server(
        [closed, cap], on_phase=lambda n, p, t, d: phases.append((n, p)),
        on_outcome=lambda o: heard.append((o.number, o.ok, len(phases))))
    assert [o.ok for o in outs] == [True, True], [o.message for o in outs]
    assert _launches(model_dir) == 1
    first, second = outs
    assert first.start_s and first.start_s > 0 and not first.server_reused
    assert second.server_reused and second.start_s == 0.0
    assert first.metrics["output_tokens_per_s"] > 0 and first.warmup and first.segments
    assert second.capacity and second.capacity["levels"] and second.warmup
    # each outcome is handed over before the next trial begins; its own phases, no restart
    assert heard[0][:2] == (0, True) and phases[heard[0][2] - 1][0] == 0
    assert next(p for n, p in phases if n == 1) == "warming_up"
    assert [p for _, p in phases].count("starting") == 1
    assert first.log_tail and second.log_tail and first.wall_s > 0 and second.wall_s > 0


def test_a_failed_trial_keeps_the_others_and_the_server_goes_on(model_dir: Path) -> None:
    ok = _fake(model_dir, "slow")
    # every request of the middle trial times out: it fails (aborted), the server lives
    failing = dataclasses.replace(ok, number=1, shape=constant_shape(
        32, 64, name="slow", load=LoadSpec(mode="open", rate_rps=80.0, requests=40)),
        measure=ok.measure.model_copy(update={"request_timeout_s": 0.02}))
    outs = run_trials_on_one_server([ok, failing, dataclasses.replace(ok, number=2)])
    assert [(o.ok, o.reason) for o in outs] == [
        (True, None), (False, FailureReason.ABORTED), (True, None)], [o.message for o in outs]
    assert outs[2].server_reused and outs[2].metrics["n_requests"] > 0
    assert _launches(model_dir) == 1


def test_a_dead_server_fails_the_rest_without_a_new_start(model_dir: Path) -> None:
    # 4 warm-up + 16 requests each (an open loop is sized by time unless --num-requests
    # bounds it): the server kills itself at request 30, in trial 1
    specs = [_fake(model_dir, "die:30", number=n, num_requests=16) for n in range(3)]
    seen: list[TrialOutcome] = []
    outs = run_trials_on_one_server(specs, on_outcome=seen.append)
    assert outs[0].ok and outs[0].metrics["n_requests"] >= 16
    assert (outs[1].ok, outs[1].reason) == (False, FailureReason.DIED), outs[1].message
    assert (outs[2].ok, outs[2].reason) == (False, FailureReason.DIED)
    assert "died during or after trial 1" in outs[2].message
    assert _launches(model_dir) == 1 and seen == outs


def test_a_server_that_does_not_start_fails_every_trial_once(model_dir: Path) -> None:
    specs = [_fake(model_dir, "exit", number=n) for n in range(2)]
    outs = run_trials_on_one_server(specs)
    assert all(not o.ok and o.reason == outs[0].reason for o in outs), outs
    assert "did not start (trial 0)" in outs[1].message
    assert _launches(model_dir) == 1


@pytest.mark.slow
@needs_vllm
def test_closed_and_capacity_shapes_on_one_cpu_vllm_start(tiny_llama: Path,
                                                          tmp_path: Path) -> None:
    """The real CPU vLLM: a closed-loop shape, then the capacity search of an open-loop one
    (two short levels) on the same server; one start in the log, each shape warmed up."""
    log = tmp_path / "server.log"
    common = {"model": str(tiny_llama), "flags": ("--max-model-len", "1024", "-O0"), "env": {},
              "log_path": str(log), "warmup_requests": 2,
              "start_timeout_s": float(os.environ.get("AUTOTUNE_TEST_START_TIMEOUT", "400"))}
    closed = flat_spec(number=0, shape=load_shape(REPO / "traffic" / "example-chat.json"),
                       num_requests=16, concurrency=4, segment_requests=8,
                       precision=0.1, warmup_max_s=10, measure_max_s=10, **common)
    cap = flat_spec(number=1, shape=load_shape(SHAPE), seed=3,
                    slo={"ttft_p99": 2.0, "tpot_p99": 0.1},
                    **capacity_spec(goodput=0.9, max_error_rate=0.05, start=0.25,
                                    tolerance=0.5, level_s=3.0, max_levels=2),
                    **common)
    first, second = run_trials_on_one_server([closed, cap])
    assert first.ok and second.ok, (first.message, second.message)
    assert first.start_s and first.start_s > 0 and first.metrics["output_tokens_per_s"] > 0
    assert first.warmup and first.warmup["segments"] >= 1
    assert second.server_reused and second.start_s == 0.0
    assert second.warmup and second.warmup["seconds"] > 0
    assert second.capacity and 1 <= len(second.capacity["levels"]) <= 2
    text = log.read_text()
    assert sum(line.startswith("$ ") for line in text.splitlines()) == 1  # one launch
