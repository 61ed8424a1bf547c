"""The files a study writes as models (``autotune.records``): every committed best.json and
study.json loads, and a file round-trips through its model with every key it had."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from autotune.errors import ConfigError
from autotune.records import BestFile, StudyFile
from tests._records import best_file
from tests.conftest import REPO


def _committed(name: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "experiments"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / p for p in out if p.endswith("/" + name)]


BEST_FILES = _committed("best.json")
STUDY_FILES = _committed("study.json")


def test_the_committed_files_are_found() -> None:
    assert len(BEST_FILES) >= 5 and len(STUDY_FILES) >= 5


@pytest.mark.parametrize(("model", "path"),
                         [(BestFile, p) for p in BEST_FILES] + [(StudyFile, p) for p in STUDY_FILES],
                         ids=lambda x: str(x.relative_to(REPO)) if isinstance(x, Path) else "")
def test_every_committed_file_loads_and_saves_back_as_it_was(
        model: type[BestFile] | type[StudyFile], path: Path, tmp_path: Path) -> None:
    loaded = model.load(path)
    raw = json.loads(path.read_text())
    # save(load(old)): every key, with its value (a key this version does not know included)
    loaded.save(tmp_path / model.FILE_NAME)
    assert json.loads((tmp_path / model.FILE_NAME).read_text()) == raw
    assert model.load(tmp_path) == loaded  # a folder names its file


@pytest.mark.parametrize("path", BEST_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_committed_best_json_reads_by_its_fields(path: Path) -> None:
    best, raw = BestFile.load(path), json.loads(path.read_text())
    assert best.trial == raw["trial"] and best.flags == raw["flags"]
    assert best.objective.value == raw["objective"]["value"]
    assert best.objective.name == raw["objective"]["name"]
    assert best.shape is not None and best.shape.fingerprint == raw["shape"]["fingerprint"]
    if raw.get("capacity"):
        assert best.capacity is not None
        assert best.capacity.capacity_rps == raw["capacity"]["capacity_rps"]
    if raw.get("baseline"):
        assert best.baseline is not None and best.baseline.value == raw["baseline"]["value"]


@pytest.mark.parametrize("path", STUDY_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_committed_study_json_reads_by_its_fields(path: Path) -> None:
    summary, raw = StudyFile.load(path), json.loads(path.read_text())
    assert summary.study == raw["study"] and summary.trials == raw["trials"]
    assert summary.best_value == raw["best_value"]
    assert summary.settings == raw["settings"] and summary.verdict == raw["verdict"]


def test_a_model_round_trips_and_an_unset_field_stays_out(tmp_path: Path) -> None:
    best = best_file("capacity", trial=3, recheck_of=2, objective={"value": 18.6},
                     readings=[18.1, 19.0], capacity={"capacity_rps_ci_high": 20.3},
                     gpus={"per_server": 2, "servers_needed": 1.5, "gpus_needed": 3.0},
                     params={"max_num_seqs": 256, "async_scheduling": True, "dtype": "auto",
                             "gpu_memory_utilization": 0.92})
    best.save(tmp_path / "best.json")
    back = BestFile.load(tmp_path / "best.json")
    assert back == best
    # parameter values keep their JSON types (a bool is no int, an int no float)
    assert back.params == {"max_num_seqs": 256, "async_scheduling": True, "dtype": "auto",
                           "gpu_memory_utilization": 0.92}
    assert type(back.params["async_scheduling"]) is bool
    doc = json.loads((tmp_path / "best.json").read_text())
    assert "cost" not in doc and "pareto_front" not in doc and "baseline" not in doc
    assert back.gpus is not None and back.gpus.per_server == 2
    assert back.objective.per_gpu is False


def test_a_file_that_is_not_a_best_json_says_which_field(tmp_path: Path) -> None:
    (tmp_path / "best.json").write_text(json.dumps({"trial": 1, "flags": [], "model": "m"}))
    with pytest.raises(ConfigError, match="objective"):
        BestFile.load(tmp_path)
    (tmp_path / "best.json").write_text("{half")
    with pytest.raises(ConfigError, match="is not JSON"):
        BestFile.load(tmp_path / "best.json")
    with pytest.raises(ConfigError, match="cannot read"):
        StudyFile.load(tmp_path / "nowhere" / "study.json")


def test_save_leaves_no_temp_file_and_replaces_the_old(tmp_path: Path) -> None:
    path = tmp_path / "out" / "best.json"
    best_file(trial=1, objective={"value": 1.0}).save(path)
    best_file(trial=2, objective={"value": 2.0}).save(path)
    assert BestFile.load(path).trial == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["best.json"]


def test_a_null_figure_and_an_unknown_key_load_and_save_back(tmp_path: Path) -> None:
    doc = {"model": "m", "flags": ["--max-num-seqs", "8"], "trial": 4,
           "objective": {"name": "throughput", "metric": "output_tokens_per_s", "value": 9.5},
           "metrics": {"output_tokens_per_s": 9.5, "ttft_p99_s": None},
           "rejudged": {"by": "a later rule", "verdict_at_run": "winner"}}
    (tmp_path / "best.json").write_text(json.dumps(doc))
    best = BestFile.load(tmp_path)
    assert best.metrics == {"output_tokens_per_s": 9.5, "ttft_p99_s": None}
    assert best.gpus is None and best.baseline is None  # written before they existed
    best.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == doc
