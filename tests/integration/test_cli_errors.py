"""Errors name what the user typed: the option (``--gpu-hour-price``), not the field it
sets (``gpu_hour_usd``), and a model folder's missing value with where to find it. The
CLI in this process; each error comes before any server starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from tests.conftest import REPO

SHAPE = str(REPO / "traffic" / "example-chat.json")


def _model(tmp_path: Path, vocab: bool = True) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    cfg = {"model_type": "llama", "max_position_embeddings": 2048}
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1000} if vocab else cfg))
    return d


def _err(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_prices_name_their_options(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    model = str(_model(tmp_path))
    err = _err(capsys, "bench", "--model", model, "--shape", SHAPE, "--gpu-hour-price", "-1")
    assert "--gpu-hour-price -1: give a positive number" in err and "usd" not in err
    err = _err(capsys, "bench", "--model", model, "--shape", SHAPE, "--gpu-hour-price", "2",
               "--growth", "0")
    assert "--growth 0: give a positive number" in err
    err = _err(capsys, "tune", "--model", model, "--shape", SHAPE, "--space",
               str(REPO / "search_spaces" / "cpu.yaml"), "--gpu-hour-price", "-1")
    assert "--gpu-hour-price -1.0" in err and "gpu_hour" not in err


def test_a_model_without_vocab_size_is_refused_with_the_value_to_add(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model(tmp_path, vocab=False)
    (model / "autotune-model.json").write_text(json.dumps({"arch": "llama", "vocab_size": 1000}))
    for argv in (["tune", "--space", str(REPO / "search_spaces" / "cpu.yaml"), "--out",
                  str(tmp_path / "out")], ["bench"]):
        err = _err(capsys, *argv, "--model", str(model), "--shape", SHAPE)
        assert f"--model {model}: {model / 'config.json'} has no vocab_size" in err, err
        assert f'add "vocab_size": 1000: {model / "autotune-model.json"} records it' in err
    assert not (tmp_path / "out").exists()  # refused before any store or folder


def test_kernels_moe_names_its_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _err(capsys, "kernels", "moe", "--model", str(_model(tmp_path)), "--shape", SHAPE,
               "--out", str(tmp_path / "k"), "--budget", "-3")
    assert "--budget: Input should be greater than 0" in err and "budget-s" not in err


def test_the_fix_commands_the_errors_suggest_run_as_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every command an error suggests runs as it is printed (issue 66: the context error
    named the shape, where `autotune shape clip` needs its file), and does what it says."""
    import re
    import shlex

    monkeypatch.chdir(tmp_path)
    model = str(_model(tmp_path))  # a 2,048-token context
    conv = str(REPO / "traffic" / "azure-conv.json")
    argv = ["tune", "--model", model, "--shape", conv, "--space",
            str(REPO / "search_spaces" / "cpu.yaml"), "--trials", "1", "--no-ray",
            "--out", str(tmp_path / "out")]
    err = _err(capsys, *argv)
    fixes = re.findall(r"autotune (shape clip [^;()]+?)(?= \(then|;|$)", err)
    assert fixes, err
    for fix in fixes:  # as printed, from the folder the failed command ran in
        assert main(shlex.split(fix)) == 0, capsys.readouterr().err
    capsys.readouterr()
    clipped = re.search(r"then tune with --shape (\S+)\)", err)
    assert clipped is not None and (tmp_path / clipped.group(1)).exists(), err
    # the clipped shape passes the check that refused the original
    from autotune.space import load_space
    from autotune.study import check_context
    from autotune.traffic import load_shape

    assert check_context(load_space(REPO / "search_spaces" / "cpu.yaml"),
                         load_shape(tmp_path / clipped.group(1)), Path(model)) == []
