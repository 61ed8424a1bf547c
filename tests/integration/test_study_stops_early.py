"""A study that stops early leaves nothing behind: no empty Optuna study, no MLflow run
RUNNING forever; and the MLflow experiment opens on its runs (MLflow 3's experiment kind).

Real parts: SQLite Optuna storage and SQLite MLflow store in ``tmp_path``, the real
``tune()`` loop; the trials are simulated (no server).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient

from autotune.config import TuneSettings
from autotune.errors import AutotuneError, StudyError
from autotune.study import tune
from autotune.testing import SimulatedExecutor
from autotune.results import EXPERIMENT_KIND, MlflowTracker
from tests._sim_tuner import value
from tests.conftest import REPO


def _settings(model: Path, tmp_path: Path, **kw: Any) -> TuneSettings:
    return TuneSettings(**{
        "model": str(model), "shape": str(REPO / "traffic" / "example-chat.json"),
        "space": str(REPO / "search_spaces" / "cpu.yaml"), "trials": 2, "seed": 1,
        "recheck": 0, "storage": f"sqlite:///{tmp_path}/optuna.db",
        "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "study_name": "s",
        "out": str(tmp_path / "out"), "quality_probe": False, "use_ray": False, **kw})


def _studies(tmp_path: Path) -> list[str]:
    db = tmp_path / "optuna.db"
    if not db.exists():
        return []
    return [s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{db}")]


def _runs(tmp_path: Path) -> list[Any]:
    if not (tmp_path / "mlflow.db").exists():
        return []
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_a_model_without_vocab_size_stops_before_any_store_is_opened(
        tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 2048}))
    sim = SimulatedExecutor(lambda params, spec: value(params))
    with pytest.raises(AutotuneError, match="no vocab_size"):
        tune(_settings(model, tmp_path), executor=sim, callbacks=[sim])
    assert _studies(tmp_path) == [] and _runs(tmp_path) == []


class _Broken(SimulatedExecutor):
    """Fails outside any trial (a bug, a lost Ray cluster): the study stops on it."""

    def submit(self, spec: Any, *, on_phase: Any = None) -> Any:
        raise StudyError("the executor is gone")


def test_a_study_stopped_by_an_error_leaves_no_running_run_and_no_empty_study(
        fake_model: Path, tmp_path: Path) -> None:
    sim = _Broken(lambda params, spec: value(params))
    with pytest.raises(StudyError, match="the executor is gone"):
        tune(_settings(fake_model, tmp_path), executor=sim, callbacks=[sim])
    assert _studies(tmp_path) == []  # no trial ran: the new study is gone
    [run] = _runs(tmp_path)
    assert run.info.status == "FAILED"
    assert "the executor is gone" in run.data.tags["autotune.failure_message"]
    # the corrected command starts the study afresh (no "already exists")
    ok = SimulatedExecutor(lambda params, spec: value(params))
    res = tune(_settings(fake_model, tmp_path), executor=ok, callbacks=[ok])
    assert res.n_trials == 2 and _studies(tmp_path) == ["s"]


def test_a_study_interrupted_after_a_trial_keeps_it_and_its_run_is_killed(
        fake_model: Path, tmp_path: Path) -> None:
    def evaluate(params: dict[str, Any], spec: Any) -> dict[str, float]:
        if spec.number == 1:
            raise KeyboardInterrupt
        return value(params)

    sim = SimulatedExecutor(evaluate)
    with pytest.raises(KeyboardInterrupt):
        tune(_settings(fake_model, tmp_path), executor=sim, callbacks=[sim])
    assert _studies(tmp_path) == ["s"]  # a trial finished: the study stays for --resume
    parent = [r for r in _runs(tmp_path) if r.data.tags.get("autotune.kind") == "study"]
    assert [r.info.status for r in parent] == ["KILLED"]
    assert parent[0].data.tags["autotune.failure_message"] == "interrupted"


def test_the_experiment_opens_on_its_runs(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowTracker(uri, experiment="fresh")
    client = MlflowClient(uri)
    key, kind = EXPERIMENT_KIND
    assert client.get_experiment_by_name("fresh").tags[key] == kind
    old = client.create_experiment("older")  # made by an older autotune, without the kind
    MlflowTracker(uri, experiment="older")
    assert client.get_experiment(old).tags[key] == kind
