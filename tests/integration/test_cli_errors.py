"""Errors name what the user typed: the option (``--gpu-hour-price``), not the field it
sets (``gpu_hour_usd``), and a model folder's missing value with where to find it. The
CLI in this process; each error comes before any server starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.load import RequestRecord
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


def _run_as_printed(command: str, cwd: Path) -> str:
    """Run an ``autotune ...`` command as a user pastes it: its own process, from ``cwd``,
    and the file its ``-o`` names (if any) is written; its standard output."""
    import shlex
    import subprocess
    import sys

    argv = shlex.split(command)
    assert argv[0] == "autotune", command
    done = subprocess.run([sys.executable, "-m", "autotune", *argv[1:]], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{command}: {done.stderr}"
    assert "-o" not in argv or (cwd / argv[argv.index("-o") + 1]).is_file(), command
    return done.stdout


def _clip_commands(text: str) -> list[str]:
    import re

    return re.findall(r"autotune shape clip .*? -o [^\s):;']+", text)


def _help(command: str) -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "autotune", command, "--help"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_the_clip_commands_of_the_load_generator_verdict_and_fit_run_as_printed(
        tmp_path: Path) -> None:
    """Issue 66: a failed replay, a capacity verdict whose search hit its top scale and a
    context check each suggest an ``autotune shape clip`` of the shape's own file, with
    the real context and a rate scale from what was measured; each runs as printed."""
    import shutil

    from autotune.deploy import check_fit
    from autotune.load import failure_abort
    from autotune.store import judge_study
    from autotune.traffic import load_shape
    from tests._capacity_study import capacity_study

    shape = tmp_path / "shapes" / "chat.json"
    shape.parent.mkdir()
    shutil.copy(SHAPE, shape)

    def rec(error: str, detail: str | None = None) -> RequestRecord:
        return RequestRecord(index=0, send_s=0.0, first_token_s=None, end_s=1.0,
                             chunk_times_s=(), chunk_tokens=(), prompt_tokens=None,
                             output_tokens=0, ok=False, error=error, detail=detail, status=None)

    messages = []
    # prompts beyond the context: vLLM's 400 names it, the command clips to it
    check = failure_abort(min_requests=4, shape_path=shape)
    detail = "This model's maximum context length is 1024 tokens. However, you requested 1500"
    messages.append(next(m for i in range(1, 5)
                         if (m := check(rec("http_4xx", detail), i, i)) is not None))
    assert "1024-token context" in messages[-1] and "--max-total-tokens 1024" in messages[-1]
    # an offered load beyond the server: 3 of 10 served, a scale of 0.24
    check = failure_abort(min_requests=10, shape_path=shape)
    for i in range(1, 11):
        line = check(rec("timeout") if i > 3 else _ok(), i, max(0, i - 3))
    assert line is not None and "--rate-scale 0.24" in line and "SHAPE" not in line
    messages.append(line)
    # a capacity search that passed at its top scale: a copy 64x as fast
    study = capacity_study([(None, 12.06 * 64, None, None, "capped"),
                            (17, 18.60, 20.28, None, "found")], recorded_rps=12.06)
    study.set_user_attr("autotune.shape_path", str(shape))
    j = judge_study(study)
    assert j is not None and "--capacity-start 256" in j.reason, j.reason
    messages.append(j.reason)
    # a context that does not hold the shape (autotune best, export)
    fit = check_fit(load_shape(shape), 256, "test", shape_path=shape)
    assert not fit.ok
    messages.append(fit.message)
    for text in messages:
        commands = _clip_commands(text)
        assert len(commands) == 1, text
        for word in ("SHAPE", "OUT", "CONTEXT", " F)", "NAME"):
            assert word not in text, text
        _run_as_printed(commands[0], tmp_path)
    assert (shape.parent / "chat-1024.json").is_file()
    assert load_shape(shape.parent / "chat-x0.24.json").input_tokens == (
        load_shape(shape).input_tokens)


def _ok() -> RequestRecord:
    return RequestRecord(index=0, send_s=0.0, first_token_s=0.1, end_s=1.0, chunk_times_s=(),
                         chunk_tokens=(), prompt_tokens=10, output_tokens=5, ok=True,
                         error=None, detail=None, status=200)


def test_a_suggested_command_that_needs_a_server_names_real_files_and_options() -> None:
    """The commands that start servers (the confirm command of an unconfirmed lead, the
    re-check a verdict asks for) are not run here: their files exist and every option
    they give is one ``autotune tune --help`` lists."""
    import re
    import shlex

    from autotune.results._outputs import confirm_command

    out = REPO / "experiments" / "h200-shapes" / "results" / "study-mooncake"
    argv = shlex.split(confirm_command(out, "study-mooncake"))
    assert argv[:2] == ["autotune", "tune"]
    assert Path(argv[argv.index("--config") + 1]).is_file()
    listed = set(re.findall(r"--[a-z][a-z0-9-]+", _help("tune")))
    # and the options the verdicts' texts name (store/_verdict.py)
    given = {a for a in argv if a.startswith("--")} | {
        "--resume", "--recheck-starts", "--capacity-start", "--capacity-max-s",
        "--capacity-max-levels", "--capacity-tolerance", "--concurrency"}
    assert given <= listed, given - listed


def test_the_export_error_suggests_a_command_that_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Given both a results folder and --study-name, export suggests the folder alone."""
    import re

    results = REPO / "experiments" / "h200-shapes" / "results" / "study-mooncake"
    err = _err(capsys, "export", str(results), "--study-name", "x", "--format", "compose")
    found = re.search(r"e\.g\. (autotune export .*--format compose)", err)
    assert found is not None, err
    assert "services:" in _run_as_printed(found.group(1), tmp_path)


def test_the_store_hints_of_export_watch_and_best_run_as_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_model: Path) -> None:
    """Issue 66: export of a study the storage does not hold, the retune command a watch
    prints on drift, and best's miss in an MLflow store each give their commands with the
    storage, model and space in use (none of 'report --storage ...', MODEL, SPACE.yaml
    or '...'); each runs as printed, or names files and options that exist. Where a value
    is not known, no command is printed, but what to give."""
    import argparse
    import re
    import shlex

    from autotune.cli._watch import _retune_command
    from autotune.traffic import load_shape
    from tests._study_verdict import study
    from tests.integration.test_study_verdict import simulated

    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 800.0}, start_cv=0.01)
    storage, tracking = f"sqlite:///{tmp_path}/optuna.db", f"sqlite:///{tmp_path}/mlflow.db"
    study(tmp_path, fake_model, fn, trials=2, recheck=0)
    elsewhere = tmp_path / "elsewhere"  # the user's shell is anywhere: absolute paths only
    elsewhere.mkdir()

    # export: the studies the storage holds, and the export of the newest
    err = _err(capsys, "export", "--storage", storage, "--study-name", "nope", "--format",
               "serve")
    assert "'sim'" in err and "report --storage" not in err, err
    found = re.search(r"e\.g\. '(autotune export [^']+)'", err)
    assert found is not None, err
    assert "study sim" in _run_as_printed(found.group(1), elsewhere)

    # watch: the retune command from the study tuned for the shape (its model and space,
    # the storage given), run on that same shape: no drift, nothing runs
    args = argparse.Namespace(model=None, space=None, url=None, on_drift=None)
    command, why_not = _retune_command(args, load_shape(SHAPE), storage, None)
    assert command is not None and why_not == ""
    assert "MODEL" not in command and "SPACE" not in command, command
    assert f"--storage {_where(storage)}" in command and str(fake_model) in command
    out = _run_as_printed(f"{command} --shape {shlex.quote(SHAPE)}", elsewhere)
    assert "did not drift" in out, out
    # nothing tuned for the shape and no --model/--space: no command with a placeholder,
    # but what to give (watch says it at its start, and again on the drift)
    command, why_not = _retune_command(args, load_shape(SHAPE),
                                       f"sqlite:///{tmp_path}/none.db", None)
    assert command is None and "it needs --model and --space (no study in" in why_not
    assert _retune_command(argparse.Namespace(model=None, space=None, url=None,
                                              on_drift="true"),
                           load_shape(SHAPE), f"sqlite:///{tmp_path}/none.db", None) == (
        None, "")

    # best in an MLflow store without a best for this shape: tune it with the store's
    # model and space, or look up the nearest tuned shape in the Optuna storage (runs)
    other = str(REPO / "traffic" / "casestudy-512x512.json")
    assert main(["best", "--shape", other, "--tracking-uri", tracking, "--storage",
                 storage]) == 1
    err = capsys.readouterr().err
    assert "..." not in err, err
    tune = re.search(r"tune it with '(autotune tune [^']+)'", err)
    look = re.search(r"'(autotune best [^']+)'", err)
    assert tune is not None and look is not None, err
    argv = shlex.split(tune.group(1))
    assert Path(argv[argv.index("--model") + 1]) == fake_model.resolve()
    assert Path(argv[argv.index("--space") + 1]).is_file()
    assert argv[argv.index("--shape") + 1] == other
    listed = set(re.findall(r"--[a-z][a-z0-9-]+", _help("tune")))
    assert {a for a in argv if a.startswith("--")} <= listed, argv
    assert "study sim" in _run_as_printed(look.group(1), elsewhere)


def _where(url: str) -> str:
    from autotune.config import store_where

    return store_where(url)
