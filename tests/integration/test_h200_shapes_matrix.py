"""experiments/h200-shapes/: the cross-evaluation matrix and its result lookups, on a
small fake result tree (pure logic, standard library; no server, no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from tests._h200_shapes_matrix import HERE, _cell, _tput, _w, steps


def test_cells_driver_writes_each_cell_when_measured_and_stops_on_sigterm(
        tmp_path: Path, fake_model: Path) -> None:
    """cells.py (dryrun.py cells: the driver itself, a stand-in for the server): a failed
    cell is a result and the next one runs; SIGTERM keeps the finished cells, marks the one
    in progress (rc 124, no JSON) and leaves the rest pending."""
    import os
    import signal
    import subprocess
    import sys
    import time

    flags = ["--max-model-len", "2048"]
    cells = [_cell(tmp_path, k, "defaults", flags) for k in ("casestudy", "azure", "mooncake")]
    files = []
    for i, c in enumerate(cells):
        f = tmp_path / f"{i:02d}.json"
        _w(f, c)
        files.append({**{k: c[k] for k in ("key", "config", "expected_s", "limit_s", "prefix")},
                      "file": str(f)})
    group = tmp_path / "g00.json"
    _w(group, {"label": "defaults", "start_expected_s": 150, "cells": files})
    repo = HERE.parents[1]
    env = dict(os.environ, DRY_SLEEP="0.8", DRY_FAIL_SHAPE="casestudy",
               PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "dryrun.py"), "cells", str(group), "--gpu", "1", "--log",
         str(tmp_path / "logs" / "server.log"), "--", "--model", str(fake_model),
         "--cache-dir", str(tmp_path / "cache"), "--seed", "0"],
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = tmp_path / "cross-azure" / "defaults.json"
    t0 = time.monotonic()
    while not second.exists() and proc.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 124, err[-2000:]
    first = json.loads((tmp_path / "cross-casestudy" / "defaults.json").read_text())
    assert first["ok"] is False and first["reason"] == "crash" and not first["server_reused"]
    assert first["start_s"] == 80.0 and first["flags"] == flags and first["env"] == {"E": "1"}
    run1 = json.loads((tmp_path / "cross-casestudy" / "defaults.run.json").read_text())
    assert run1["rc"] == 1 and run1["gpu"] == 1 and run1["server_start_s"] == 80.0
    assert run1["server_cells"] == ["casestudy/defaults", "azure/defaults", "mooncake/defaults"]
    got = json.loads(second.read_text())
    assert got["ok"] and got["server_reused"] and got["start_s"] == 0.0
    assert got["metrics"]["capacity_rps"] > 0  # azure: bench --capacity
    assert steps.cell_result("azure", "defaults", [tmp_path])[0] == "json"
    # the cell in progress: a run.json (rc 124), no result: measured again when resumed
    third = tmp_path / "cross-mooncake"
    assert json.loads((third / "defaults.run.json").read_text())["rc"] == 124
    assert not (third / "defaults.json").exists()
    assert steps.cell_result("mooncake", "defaults", [tmp_path]) is None
    for key in ("casestudy", "azure", "mooncake"):  # each cell's log lines and log part
        assert (tmp_path / f"cross-{key}" / "defaults.err").read_text().startswith("benchmarking")
        assert (tmp_path / f"cross-{key}" / "defaults-server-log.tgz").stat().st_size > 0
    assert "cross:casestudy defaults on gpu1 exit 1 (crash)" in out
    assert "cross:mooncake defaults on gpu1 exit 124" in out


def test_plan_puts_the_cells_that_check_a_verdict_first(tmp_path: Path) -> None:
    # study:casestudy is done and its defaults cell measured: its winner's casestudy cell
    # (the other half of the verdict's re-measure) comes before every other server
    r = tmp_path / "results"
    _w(r / "study-casestudy" / "DONE", "")
    _w(r / "study-casestudy" / "best.json", {
        "verdict": "winner", "trial": 1, "params": {"cudagraph_cover_prefill": True},
        "objective": {"value": 7611.0}, "env": {},
        "flags": ["--max-model-len", "2048", "--max-num-seqs", "1024"]})  # fmt: skip
    _w(r / "cross-casestudy" / "defaults.json", _tput(7408.0, 500.0))
    assert steps.checks_verdict("casestudy", "win-casestudy", [r])
    assert steps.checks_verdict("casestudy", "defaults", [r])
    assert not steps.checks_verdict("casestudy", "recipe", [r])
    assert not steps.checks_verdict("azure", "defaults", [r])  # study:azure not run
    lines = steps.plan(tmp_path / "res", tmp_path / "run", ["casestudy", "azure"], [r])
    labels = [ln.split("\t")[1] for ln in lines]
    assert labels[0] == "win-casestudy" and set(labels) == {"win-casestudy", "defaults", "recipe"}
    first = json.loads(Path(lines[0].split("\t")[0]).read_text())
    assert [c["key"] for c in first["cells"]] == ["casestudy", "azure"]
    # without the study, shapes.json's order: the defaults' server first
    r2 = tmp_path / "none"
    r2.mkdir()
    lines = steps.plan(tmp_path / "res2", tmp_path / "run2", ["casestudy"], [r2])
    assert [ln.split("\t")[1] for ln in lines] == ["defaults", "recipe"]


def test_committed_studies_carry_the_verdict_the_current_rule_gives(tmp_path: Path) -> None:
    # rejudge.py judges each committed study again from its Optuna store: "unchanged" means
    # study.json, best.json and the store hold what this checkout's rule says (a rule
    # change that moves a committed verdict fails here: run rejudge.py and commit)
    import shutil
    import subprocess
    import sys

    res = tmp_path / "results"
    shutil.copytree(HERE / "results", res)
    done = subprocess.run([sys.executable, str(HERE / "rejudge.py"), "--results", str(res),
                           "casestudy", "azure", "mooncake"], cwd=HERE.parents[1],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(HERE.parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("study:casestudy: unchanged (winner"), lines
    assert lines[1].startswith("study:azure: unchanged (winner"), lines
    assert "search readings included" in lines[1]
    # study:mooncake: searched with --recheck 0, then re-checked with --resume on one fresh
    # start each: the defaults' second start read 14.8 req/s, 9.1 % start-to-start SD
    assert lines[2].startswith("study:mooncake: unchanged (defaults_best"), lines
    best = json.loads((res / "study-azure" / "best.json").read_text())
    # the re-check's run judged with the fresh starts' spread alone (df 2): defaults_best
    assert best["rejudged"]["verdict_at_run"] == "defaults_best" and best["is_baseline"] is False


def test_pooled_md_is_what_pooled_py_makes_of_the_committed_results(tmp_path: Path) -> None:
    # every start of each config on each shape (studies and cross cells), the README's
    # pooled figures: regenerated here, so newly committed results cannot leave it stale
    import subprocess
    import sys

    out = tmp_path / "pooled.md"
    r = subprocess.run([sys.executable, str(HERE / "pooled.py"), "--out", str(out)],
                       cwd=HERE.parents[1], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_text() == (HERE / "pooled.md").read_text(), \
        "rerun: .venv/bin/python experiments/h200-shapes/pooled.py"
    azure = out.read_text().split("## azure", 1)[1].split("## ", 1)[0]
    recipe = next(ln for ln in azure.splitlines() if ln.startswith("| recipe |"))
    assert "| 4 |" in recipe and "cross cell" in recipe  # study starts and the cross cell
