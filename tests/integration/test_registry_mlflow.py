"""``autotune best --shape S --tracking-uri URI``: the winner per shape from an MLflow store
(the trial runs tagged ``autotune.best_for_shape``), for the three shapes of issue 15.

The store is written by :class:`autotune.tracking.MlflowTracker` as a study writes it (a
study run, a run per trial, ``mark_best`` with best.json), in ``tmp_path``; one test runs a
whole study (the real ``tune()``, simulated trials) into it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest

from autotune.cli import main
from autotune.records import BestFile
from autotune.results import find_best, find_best_tracked
from autotune.results import BEST_VALUE, TAGS, MlflowTracker
from autotune.traffic import TrafficShape, load_shape
from tests.conftest import REPO, at_once

SHAPES = ("azure-conv-2k", "mooncake-conv-2k", "casestudy-512x512")


def _study(uri: str, shape: TrafficShape, study: str, trials: list[tuple[int, float]], *,
           best: int, objective: str = "throughput", gpu: str = "NVIDIA H200",
           artifacts: bool = True, readings: list[float] | None = None,
           params: dict[str, Any] | None = None) -> None:
    """A study's runs: ``trials`` = [(max_num_seqs, value)], ``best`` the winner's index;
    ``readings``: the winner's (its declared value is their median; its run has the first),
    ``params``: more params of every trial. ``artifacts=False``: an old-style store (only the
    tags, no best.json, no declared figures on the study run)."""
    metric = "capacity_rps" if objective == "capacity" else "output_tokens_per_s"
    tr = MlflowTracker(uri, experiment="autotune")
    tags = {TAGS["shape"]: shape.fingerprint, TAGS["model"]: "/models/nemotron3-nano-30b",
            TAGS["engine"]: "vllm 0.26.0", TAGS["gpu"]: gpu, TAGS["study"]: study}
    tr.start_study(study_name=study, tags=tags, params={"objective": objective})
    rids = []
    for i, (seqs, value) in enumerate(trials):
        flags = ["--max-model-len", "2048", "--max-num-seqs", str(seqs)]
        rids.append(tr.log_trial(number=i, params={"max_num_seqs": seqs, **(params or {})},
                                 flags=flags, env={"OMP_NUM_THREADS": "1"},
                                 metrics={metric: value, "ttft_p99_s": 0.5},
                                 tags=tags, ok=True))
    seqs, value = trials[best]
    readings = readings or [value]
    doc = {"study": study, "trial": best, "params": {"max_num_seqs": seqs, **(params or {})},
           "objective": {"name": objective, "metric": metric,
                         "value": statistics.median(readings)},
           "readings": readings, "flags": ["--max-model-len", "2048", "--max-num-seqs", str(seqs)],
           "env": {"OMP_NUM_THREADS": "1"}, "metrics": {metric: value},
           "serve_command": f"vllm serve /models/nemotron3-nano-30b --max-num-seqs {seqs}",
           "shape": {"name": shape.name, "fingerprint": shape.fingerprint,
                     "path": f"traffic/{shape.name}.json"},
           "model": "/models/nemotron3-nano-30b", "is_baseline": best == 0}
    rid = rids[best]
    assert rid is not None
    if artifacts:
        tr.mark_best(run_id=rid, shape_fingerprint=shape.fingerprint,
                     best=BestFile.model_validate(doc),
                     serve_command=doc["serve_command"])
    else:
        tr.client.set_tag(rid, "autotune.best", "true")
        tr.client.set_tag(rid, "autotune.best_for_shape", shape.fingerprint)
        tr.client.set_tag(tr.parent_run_id, "autotune.best_run_id", rid)
    tr.end_study()


def _study_run_id(uri: str) -> str:
    """The id of the (one) study run in the store at ``uri``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("autotune")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id],
                              filter_string="tags.`autotune.kind` = 'study'")
    assert len(runs) == 1
    return str(runs[0].info.run_id)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One study per shape with a different winner; a capacity study of azure-conv-2k; a
    study of azure-conv-2k on another GPU."""
    tmp = tmp_path_factory.mktemp("mlflow-reg")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    shapes = {n: load_shape(REPO / "traffic" / f"{n}.json") for n in SHAPES}
    _study(uri, shapes["azure-conv-2k"], "h200-azure", [(1024, 9000.0), (128, 11000.0),
                                                        (256, 10500.0)], best=1)
    _study(uri, shapes["mooncake-conv-2k"], "h200-mooncake", [(1024, 5000.0), (64, 4000.0),
                                                              (512, 6200.0)], best=2)
    _study(uri, shapes["casestudy-512x512"], "h200-casestudy", [(1024, 12300.0),
                                                                (256, 14900.0)], best=1)
    _study(uri, shapes["azure-conv-2k"], "h200-azure-capacity", [(1024, 40.0), (256, 55.0)],
           best=1, objective="capacity")
    _study(uri, shapes["azure-conv-2k"], "a100-azure", [(1024, 99999.0)], best=0, gpu="A100")
    return {"uri": uri, "shapes": shapes, "tmp": tmp}


@pytest.mark.parametrize(("name", "study", "seqs", "value"), [
    ("azure-conv-2k", "h200-azure", 128, 11000.0),
    ("mooncake-conv-2k", "h200-mooncake", 512, 6200.0),
    ("casestudy-512x512", "h200-casestudy", 256, 14900.0),
])
def test_best_for_each_shape_comes_from_its_tagged_run(
        store: dict[str, Any], capsys: pytest.CaptureFixture[str], name: str, study: str,
        seqs: int, value: float) -> None:
    argv = ["best", "--shape", str(REPO / "traffic" / f"{name}.json"),
            "--tracking-uri", store["uri"], "--gpu", "H200", "--json"]
    assert main(argv) == 0
    hit = json.loads(capsys.readouterr().out)
    assert hit["study"] == study and hit["params"] == {"max_num_seqs": seqs}
    assert hit["value"] == value and hit["exact"] and hit["gpu_type"] == "NVIDIA H200"
    assert hit["shape_fingerprint"] == store["shapes"][name].fingerprint
    assert f"--max-num-seqs {seqs}" in hit["serve_command"]
    assert hit["objective"] == "throughput"  # a capacity study does not mix in


def test_gpu_filter_and_a_plain_text_answer(store: dict[str, Any],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    shape = store["shapes"]["azure-conv-2k"]
    hit = find_best_tracked(tracking_uri=store["uri"], shape=shape, gpu="a100")
    assert hit is not None and hit.study == "a100-azure" and hit.is_baseline
    assert main(["best", "--shape", str(REPO / "traffic" / "azure-conv-2k.json"),
                 "--tracking-uri", store["uri"], "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "study h200-azure, trial 1: 11,000 output_tokens_per_s" in out
    assert "vllm serve /models/nemotron3-nano-30b --max-model-len 2048 --max-num-seqs 128" in out


def test_an_untuned_shape_says_how_to_tune_it(store: dict[str, Any],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["best", "--shape", str(REPO / "traffic" / "example-chat.json"),
                 "--tracking-uri", store["uri"]]) == 1
    err = capsys.readouterr().err
    assert "autotune.best_for_shape=" in err
    # no study in the store names a model and space: the tune step says which to give
    assert "'autotune tune' with --model, --space and --tracking-uri" in err
    assert f"autotune best --shape {REPO / 'traffic' / 'example-chat.json'} --storage" in err


def test_a_study_run_declares_its_best_without_artifacts(
        tmp_path: Path, fake_model: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole study (re-checked leaders: the declared value is a median of readings that
    differ) into a store whose artifact folder is then removed, as a store copied from a GPU
    host without it: the MLflow answer is still the Optuna storage's, figure for figure."""
    from mlflow.tracking import MlflowClient

    from autotune.config import TuneSettings
    from autotune.study import tune
    from autotune.testing import SimulatedExecutor
    from autotune.trial import TrialSpec

    def evaluate(params: dict[str, Any], spec: TrialSpec) -> dict[str, float]:
        # every start reads differently (a fresh server is not the same server)
        tput = (1000.0 + 10 * int(params.get("max_num_seqs", 16))
                + (50.0 if params.get("enable_chunked_prefill") else 0.0)) * (
            1 + 0.01 * (spec.number % 3))
        return {"output_tokens_per_s": tput, "ttft_p99_s": 0.5, "error_rate": 0.0}

    uri, storage = f"sqlite:///{tmp_path / 'mlflow.db'}", f"sqlite:///{tmp_path / 'optuna.db'}"
    shape_path = REPO / "traffic" / "example-chat.json"
    settings = TuneSettings(
        model=fake_model, shape=shape_path, space=REPO / "search_spaces" / "cpu.yaml",
        storage=storage, tracking_uri=uri, study_name="sim", out=tmp_path / "out",
        trials=4, seed=3, recheck=1, recheck_starts=2, quality_probe=False, use_ray=False)
    sim = SimulatedExecutor(evaluate)
    tune(settings, executor=sim, callbacks=[sim])
    best = json.loads((tmp_path / "out" / "best.json").read_text())
    shape = load_shape(shape_path)
    declared = find_best(storage=storage, shape=shape)
    assert declared is not None and len(set(declared.readings)) > 1
    assert (declared.value, declared.readings) == (best["objective"]["value"], best["readings"])

    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    capfd.readouterr()
    with_files = find_best_tracked(tracking_uri=uri, shape=shape)
    assert with_files is not None and not with_files.notes
    shutil.rmtree(tmp_path / "mlartifacts")
    alone = find_best_tracked(tracking_uri=uri, shape=shape)
    assert alone is not None
    # neither lookup drew MLflow's download bar, and the variable is as it was
    assert "Downloading artifacts" not in capfd.readouterr().err
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ
    for hit in (with_files, alone):
        assert (hit.study, hit.trial, hit.value) == (declared.study, declared.trial,
                                                     declared.value)
        assert hit.readings == declared.readings and hit.params == declared.params
        assert hit.params == best["params"]  # typed: ints and bools, not their strings
        assert {type(v) for v in hit.params.values()} != {str}
    assert alone.notes == [f"MLflow run {_study_run_id(uri)}: no best.json artifact; figures "
                           "of the study run's record"]
    # the trial run alone has its first reading, not the declared median
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("autotune")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id],
                              filter_string="tags.`autotune.best_for_shape` != ''")
    assert len(runs) == 1 and runs[0].data.metrics["output_tokens_per_s"] != alone.value


def test_the_study_run_record_answers_and_a_too_long_tag_is_left_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The declared value and readings come from the study run's record; params too long
    for a tag are left out with a warning (a cut JSON would not read back), so they come
    from the trial run, typed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shape = load_shape(REPO / "traffic" / "casestudy-512x512.json")
    # each param fits MLflow's param limit, all of them as JSON not a tag's
    long: dict[str, Any] = {f"knob_{i:02d}": "x" * 100 for i in range(60)}
    long["enable_prefix_caching"] = False
    with caplog.at_level(logging.WARNING, logger="autotune.tracking"):
        _study(uri, shape, "long", [(1024, 7676.3), (256, 7000.0)], best=0,
               readings=[7676.3, 7546.0], params=long)
    assert any(TAGS["best_params"] in r.getMessage() for r in caplog.records)
    shutil.rmtree(tmp_path / "mlartifacts")
    parent = MlflowTracker(uri).client.get_run(_study_run_id(uri))
    assert parent.data.metrics[BEST_VALUE] == pytest.approx(7611.15)
    assert json.loads(parent.data.tags[TAGS["best_readings"]]) == [7676.3, 7546.0]
    assert parent.data.tags[TAGS["best_trial"]] == "0"
    assert TAGS["best_params"] not in parent.data.tags
    hit = find_best_tracked(tracking_uri=uri, shape=shape)
    assert hit is not None and hit.value == pytest.approx(7611.15) and hit.trial == 0
    assert hit.readings == [7676.3, 7546.0]
    assert hit.params == {"max_num_seqs": 1024, **long}
    assert "study run's record" in hit.notes[0]


def test_an_old_store_without_artifacts_answers_from_the_trial_run(
        tmp_path: Path, store: dict[str, Any]) -> None:
    """Only the database was kept (its artifact folder is gone) and its study run has no
    declared figures (written before autotune recorded them): the trial run's figures, its
    params typed back from MLflow's strings, and a note that the value is one reading."""
    shutil.copyfile(store["tmp"] / "mlflow.db", tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shape = store["shapes"]["mooncake-conv-2k"]
    params = {"enable_prefix_caching": False, "gpu_memory_utilization": 0.9,
              "kv_cache_dtype": "auto", "odd": "NaN", "nothing": None}
    _study(uri, shape, "no-artifacts", [(32, 7777.0)], best=0, gpu="L4", artifacts=False,
           params=params)
    hit = find_best_tracked(tracking_uri=uri, shape=shape, gpu="L4")
    assert hit is not None and hit.value == 7777.0 and hit.readings == [7777.0]
    assert hit.params == {"max_num_seqs": 32, **params}  # "NaN" stays a string
    assert "--max-num-seqs 32" in hit.serve_command
    assert len(hit.notes) == 1 and "no best.json artifact" in hit.notes[0]
    assert "single reading" in hit.notes[0]


def test_a_missing_store_is_not_created(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    shape = load_shape(REPO / "traffic" / "azure-conv-2k.json")
    assert find_best_tracked(tracking_uri=uri, shape=shape) is None
    assert not (tmp_path / "none").exists()


def _track(url: str) -> str:
    return MlflowTracker(url).experiment_id


def test_tuners_opening_a_fresh_mlflow_store_at_once_share_one_experiment(
        tmp_path: Path) -> None:
    # MLflow creates and migrates a SQLite store on first use; before the lock, 3 tuners
    # at once failed in 6 rounds of 6 ("table registered_models already exists", alembic's
    # migration rows)
    for round_ in range(2):
        url = f"sqlite:///{tmp_path}/r{round_}/mlflow.db"
        got = at_once(_track, url, 3)
        assert len(set(got)) == 1 and got[0].isdigit(), got  # one experiment, its id
        assert MlflowTracker(url).experiment_id == got[0]
