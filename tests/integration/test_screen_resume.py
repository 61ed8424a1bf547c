"""Screen, then refine on a real CPU vLLM server, and across ``--resume``.

The study's first session fills rung 0 (three coarse readings, every one promoted, and a
full-resolution incumbent) with a simulated executor; the resumed session starts a real
server for its next config, reads it at the coarse fidelity, finds it no leader against the
rung the storage kept, and stops it there: screened, its coarse reading kept in Optuna and
MLflow, never in the verdict; the first session's rungs stand, and the summary counts both.

Real parts: the CPU vLLM server (tiny llama), the load generator, SQLite Optuna and MLflow
stores in ``tmp_path``, the real ``tune()`` loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient

from autotune.config import TuneSettings
from autotune.store import A, State
from autotune.study import promotion_bar, rung0_readings, tune
from autotune.testing import SimulatedExecutor, fidelity_outcome
from tests.conftest import REPO, needs_vllm

#: the simulated first session's readings (tok/s): far above what a tiny CPU server reads
FAST = 1.0e6


def _settings(model: Path, tmp_path: Path, trials: int, **kw: Any) -> TuneSettings:
    return TuneSettings(**{
        "model": str(model), "shape": str(REPO / "traffic" / "example-chat.json"),
        "space": str(REPO / "search_spaces" / "cpu.yaml"), "trials": trials, "seed": 1,
        "objective": "throughput", "recheck": 0, "sampler": "random",
        # the pruner would stop this study's real trial first (its bar is the simulated
        # incumbent's): off, so that screening alone judges it
        "pruner": "none",
        "storage": f"sqlite:///{tmp_path}/optuna.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "study_name": "screen",
        "out": str(tmp_path / "out"), "quality_probe": False, "use_ray": False,
        "cache_dir": str(tmp_path / "cache"),
        # short adaptive measurements: segments of 4 requests at 4 streams, 15 % precision
        # (the coarse reading: 45 %, after 3 segments of about 2 s: CPU segments of one run
        # vary by 10-20 %), an 8 s warm-up cap, room for the coarse reading
        "num_requests": 16, "concurrency": 4, "segment_requests": 4, "precision": 0.15,
        "warmup_max_s": 8, "measure_max_s": 30, **kw})


@needs_vllm
@pytest.mark.slow
def test_a_resumed_study_screens_a_real_trial_against_the_rungs_it_kept(
        tiny_llama: Path, tmp_path: Path) -> None:
    def simulated(params: dict[str, Any], spec: Any) -> Any:
        full = FAST * (1.0 + 0.01 * (spec.number % 5))
        return fidelity_outcome(spec, full=full, coarse=full)

    sim = SimulatedExecutor(simulated)
    first = tune(_settings(tiny_llama, tmp_path, 4), executor=sim, callbacks=[sim])
    assert first.rungs == {"screened": 0, "refined": 3}
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.load_study(study_name="screen", storage=storage)
    kept = {t.number: t.user_attrs.get(A.RUNG) for t in study.trials}
    bar = promotion_bar(rung0_readings(study.trials))
    assert bar >= FAST
    # the next config: every knob given, a start known to work on the CPU build
    study.enqueue_trial({**study.trials[0].params, "max_num_seqs": 8,
                         "max_num_batched_tokens": 1024, "enable_chunked_prefill": True,
                         "enable_prefix_caching": False})

    resumed = tune(_settings(tiny_llama, tmp_path, 5, resume=True))
    study = optuna.load_study(study_name="screen", storage=storage)
    real = study.trials[-1]
    ua = real.user_attrs
    assert ua.get(A.STATE) == State.SCREENED, (ua.get(A.STATE), ua.get(A.MESSAGE))
    assert real.state == optuna.trial.TrialState.PRUNED and ua[A.RUNG] == 0
    coarse = ua[A.SCREEN]
    assert 0 < coarse["value"] < bar and coarse["bar"] == bar and not coarse["promoted"]
    assert coarse["ci_low"] <= coarse["value"] <= coarse["ci_high"]
    assert ua[A.METRICS]["output_tokens_per_s"] > 0 and real.intermediate_values
    # the first session's rungs are as they were; the summary counts both sessions
    assert {n: study.trials[n].user_attrs.get(A.RUNG) for n in kept} == kept
    assert resumed.rungs == {"screened": 1, "refined": 3}
    summary = json.loads((tmp_path / "out" / "study.json").read_text())
    assert summary["rungs"] == {"screened": 1, "refined": 3} and summary["failed"] == 0
    assert study.user_attrs[A.GPU_PHASES]["screened"] > 0
    # never the verdict's: its candidate is a full-resolution trial
    assert resumed.verdict.get("candidate_number") != real.number
    # MLflow keeps the screened trial's reading and rung
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`autotune.trial_number` = '{real.number}'")
    assert runs, "the screened trial has no MLflow run"
    run = runs[0]
    assert run.data.tags["autotune.rung"] == "0"
    assert run.data.metrics["screen_value"] == pytest.approx(coarse["value"])
    assert run.data.tags["autotune.trial_state"] == "screened"
