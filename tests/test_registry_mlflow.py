"""``autotune best --shape S --tracking-uri URI``: the winner per shape from an MLflow store
(the trial runs tagged ``autotune.best_for_shape``), for the three shapes of issue 15.

The store is written by :class:`autotune.tracking.MlflowTracker` as a study writes it (a
study run, a run per trial, ``mark_best`` with best.json), in ``tmp_path``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from autotune.cli import main
from autotune.registry import find_best_tracked
from autotune.tracking import TAGS, MlflowTracker
from autotune.traffic import TrafficShape, load_shape
from tests.conftest import REPO

SHAPES = ("azure-conv-2k", "mooncake-conv-2k", "casestudy-512x512")


def _study(uri: str, shape: TrafficShape, study: str, trials: list[tuple[int, float]], *,
           best: int, objective: str = "throughput", gpu: str = "NVIDIA H200",
           artifacts: bool = True) -> None:
    """A study's runs: ``trials`` = [(max_num_seqs, value)], ``best`` the winner's index."""
    metric = "capacity_rps" if objective == "capacity" else "output_tokens_per_s"
    tr = MlflowTracker(uri, experiment="autotune")
    tags = {TAGS["shape"]: shape.fingerprint, TAGS["model"]: "/models/nemotron3-nano-30b",
            TAGS["engine"]: "vllm 0.26.0", TAGS["gpu"]: gpu, TAGS["study"]: study}
    tr.start_study(study_name=study, tags=tags, params={"objective": objective})
    rids = []
    for i, (seqs, value) in enumerate(trials):
        flags = ["--max-model-len", "2048", "--max-num-seqs", str(seqs)]
        rids.append(tr.log_trial(number=i, params={"max_num_seqs": seqs}, flags=flags,
                                 env={"OMP_NUM_THREADS": "1"},
                                 metrics={metric: value, "ttft_p99_s": 0.5},
                                 tags=tags, ok=True))
    seqs, value = trials[best]
    doc = {"study": study, "trial": best, "params": {"max_num_seqs": seqs},
           "objective": {"name": objective, "metric": metric, "value": value},
           "readings": [value], "flags": ["--max-model-len", "2048", "--max-num-seqs", str(seqs)],
           "env": {"OMP_NUM_THREADS": "1"}, "metrics": {metric: value},
           "serve_command": f"vllm serve /models/nemotron3-nano-30b --max-num-seqs {seqs}",
           "shape": {"name": shape.name, "fingerprint": shape.fingerprint,
                     "path": f"traffic/{shape.name}.json"},
           "model": "/models/nemotron3-nano-30b", "is_baseline": best == 0}
    rid = rids[best]
    assert rid is not None
    if artifacts:
        tr.mark_best(run_id=rid, shape_fingerprint=shape.fingerprint, best=doc,
                     serve_command=doc["serve_command"])
    else:
        tr.client.set_tag(rid, "autotune.best", "true")
        tr.client.set_tag(rid, "autotune.best_for_shape", shape.fingerprint)
        tr.client.set_tag(tr.parent_run_id, "autotune.best_run_id", rid)
    tr.end_study()


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
    assert "study h200-azure, trial 1: 11,000.0 output_tokens_per_s" in out
    assert "vllm serve /models/nemotron3-nano-30b --max-num-seqs 128" in out


def test_an_untuned_shape_says_how_to_tune_it(store: dict[str, Any],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["best", "--shape", str(REPO / "traffic" / "example-chat.json"),
                 "--tracking-uri", store["uri"]]) == 1
    err = capsys.readouterr().err
    assert "autotune.best_for_shape=" in err and "autotune tune --shape" in err


def test_a_store_without_artifacts_answers_from_the_run(tmp_path: Path,
                                                       store: dict[str, Any]) -> None:
    """Only the database was kept (its artifact folder is gone): the trial run's figures."""
    shutil.copyfile(store["tmp"] / "mlflow.db", tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shape = store["shapes"]["mooncake-conv-2k"]
    _study(uri, shape, "no-artifacts", [(32, 7777.0)], best=0, gpu="L4", artifacts=False)
    hit = find_best_tracked(tracking_uri=uri, shape=shape, gpu="L4")
    assert hit is not None and hit.value == 7777.0 and hit.params == {"max_num_seqs": "32"}
    assert "--max-num-seqs 32" in hit.serve_command and hit.notes


def test_a_missing_store_is_not_created(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    shape = load_shape(REPO / "traffic" / "azure-conv-2k.json")
    assert find_best_tracked(tracking_uri=uri, shape=shape) is None
    assert not (tmp_path / "none").exists()
