"""Where a study's stores are: with --out DIR they are in DIR (the Optuna storage and the
MLflow store), the study says so at its start and end, and every reader pointed at DIR
finds the study, or says where it looked. The real loop, SQLite stores and MLflow, a
simulated executor instead of vLLM servers."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from autotune.cli import main
from autotune.cli._progress import ProgressDisplay
from autotune.config import TuneSettings
from autotune.study import tune
from autotune.testing import SimulatedExecutor
from autotune.trial import TrialSpec
from tests.conftest import REPO

SHAPE = REPO / "traffic" / "example-chat.json"


def _value(params: dict[str, Any], spec: TrialSpec) -> dict[str, float]:
    tput = 100.0 + int(params.get("max_num_seqs", 16))
    return {"output_tokens_per_s": tput, "ttft_p99_s": 0.5, "error_rate": 0.0}


@pytest.fixture
def model(fake_model: Path) -> Path:
    return fake_model


def _study(model: Path, out: Path, tracker: Any = None, **kw: Any) -> tuple[Any, str]:
    from rich.console import Console

    lines = io.StringIO()
    display = ProgressDisplay("out tok/s", console=Console(file=lines, width=300), live=False,
                              quiet=True)
    sim = SimulatedExecutor(_value)
    settings = TuneSettings(**{
        "model": model, "shape": SHAPE, "space": REPO / "search_spaces" / "cpu.yaml",
        "trials": 2, "recheck": 0, "out": out, "study_name": "s", "quality_probe": False,
        "use_ray": False, **kw})
    result = tune(settings, executor=sim, tracker=tracker, callbacks=[sim, display])
    return result, lines.getvalue()


def test_a_study_given_out_keeps_its_stores_there_and_readers_find_it(
        model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = tmp_path / "runs" / "a"
    result, shown = _study(model, out)
    assert (out / "autotune.db").is_file() and (out / "mlflow.db").is_file()
    assert not (cwd / "experiments").exists()  # nothing in the working directory
    where = f"stores: Optuna sqlite:///{out}/autotune.db, MLflow sqlite:///{out}/mlflow.db"
    assert shown.count(where) == 2, shown  # at the start and at the end
    assert result.storage == f"sqlite:///{out}/autotune.db"
    assert json.loads((out / "study.json").read_text())["storage"] == result.storage

    # readers pointed at the study's folder find it
    capsys.readouterr()
    assert main(["best", "--shape", str(SHAPE), "--storage", str(out)]) == 0
    assert "study s, trial" in capsys.readouterr().out
    assert main(["report", "--out", str(out), "-o", str(tmp_path / "r.html")]) == 0
    assert "autotune study s" in (tmp_path / "r.html").read_text()
    assert main(["export", "--study-name", "s", "--storage", str(out),
                 "--format", "serve"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    assert main(["best", "--shape", str(SHAPE), "--tracking-uri", str(out)]) == 0

    # readers that find nothing say where they looked, and how to point them
    capsys.readouterr()
    assert main(["best", "--shape", str(SHAPE)]) == 1
    err = capsys.readouterr().err
    assert f"no tuned study in sqlite:///{cwd}/experiments/autotune.db (no such file)" in err
    assert "--out folder" in err and "--storage" in err
    assert main(["report", "-o", str(tmp_path / "r2.html")]) == 2
    err = capsys.readouterr().err
    assert f"no study in sqlite:///{cwd}/experiments/autotune.db" in err and "--out" in err
    assert not (cwd / "experiments").exists()  # looking left no empty store behind


def test_an_out_folder_whose_stores_are_elsewhere_resumes_and_reads_there(
        model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A study run with --storage of its own (a team's database; or one written before the
    stores followed --out): its folder's study.json names the store, so --out and readers
    pointed at the folder find it there."""
    monkeypatch.chdir(tmp_path)
    shared = f"sqlite:///{tmp_path}/shared.db"
    out = tmp_path / "b"
    _study(model, out, tracker=False, storage=shared)
    assert not (out / "autotune.db").exists()
    result, _ = _study(model, out, tracker=False, resume=True, trials=3)
    assert result.storage == shared and result.n_trials == 3  # resumed in the shared store
    assert main(["best", "--shape", str(SHAPE), "--storage", str(out)]) == 0
    assert "study s, trial" in capsys.readouterr().out
