"""experiments/h200-shapes/: the cross-evaluation matrix and its result lookups, on a (the pure part: no server, no subprocess; the rest is tests/integration/test_h200_shapes_matrix.py)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests._h200_shapes_matrix import HERE, _cell, _tput, _w, matrix, steps


def _cap(c: float, hi: float | None) -> dict:
    m = {"capacity_rps": c, "capacity_rps_ci_low": c, "output_tokens_per_s_at_capacity": 9000.0}
    if hi is not None:
        m["capacity_rps_ci_high"] = hi
    return {
        "ok": True,
        "start_s": 85.0,
        "warmup": {"seconds": 15.0},
        "measure_s": 150.0,
        "metrics": m,
    }


def _tree(tmp_path: Path) -> Path:
    r = tmp_path / "results"
    _w(r / "study-casestudy" / "DONE", "")
    _w(
        r / "study-casestudy" / "best.json",
        {
            "verdict": "winner",
            "ratio_to_defaults": {"median": 1.3, "ci_low": 1.2, "ci_high": 1.4},
            "params": {"cudagraph_cover_prefill": True, "max_num_seqs": 1024},
            "trial": 1,
            "objective": {"value": 15000.0},
            "flags": ["--max-model-len", "2048"],
            "env": {},
        },
    )
    _w(
        r / "study-casestudy" / "step.json",
        {"step": "study:casestudy", "wall_s": 700, "started": "2026-12-02T10:00:00Z", "rc": 0},
    )
    c = r / "cross-casestudy"
    _w(c / "defaults.json", _tput(10000.0, 300.0, ttft_p99_s=2.0, tpot_p99_s=0.02))
    _w(c / "recipe.json", _tput(12000.0, 360.0, ttft_p99_s=1.0, tpot_p99_s=0.09))
    _w(c / "win-casestudy.json", _tput(15000.0, 450.0, ttft_p99_s=1.5, tpot_p99_s=0.02))
    _w(c / "win-casestudy.run.json", {"gpu": 1, "wall_s": 230})
    a = r / "cross-azure"
    _w(a / "defaults.json", _cap(40.0, 44.0))
    _w(a / "recipe.json", {"ok": False, "reason": "start_failed", "message": "OOM", "metrics": {}})
    _w(a / "win-casestudy.json", _cap(50.0, None))  # passed at the top scale: no upper end
    _w(a / "win-azure.same", "defaults\n")  # study:azure kept the defaults
    _w(r / "study-azure" / "DONE", "")
    _w(
        r / "study-azure" / "best.json",
        {
            "verdict": "defaults_best",
            "trial": 0,
            "params": {},
            "is_baseline": True,
            "objective": {"value": 40.0},
            "baseline": {"value": 40.0},
            "capacity": {"recorded_rps": 5.53},
            "flags": [],
            "env": {},
        },
    )
    _w(a / "win-mooncake.json.part", "{trunc")  # a bench killed mid-way: not a result
    return r


def test_cells_ratios_and_reasons(tmp_path: Path) -> None:
    rows = {(x["shape"], x["config"]): x for x in matrix.build(_tree(tmp_path))}
    assert len(rows) == 15
    d, rec, win = (rows[("casestudy", k)] for k in ("defaults", "recipe", "win-casestudy"))
    assert d["status"] == "measured" and d["ratio"] == 1.0
    assert math.isclose(win["ratio"], 1.5)
    # delta method: half-widths 3 % on both -> se of the log ratio sqrt(2) x 3 % / 1.96
    se = math.hypot(*[(math.log(1.03) - math.log(0.97)) / (2 * matrix.Z)] * 2)
    assert math.isclose(win["ratio_low"], 1.5 * math.exp(-matrix.Z * se))
    assert win["gpu"] == 1 and win["wall_s"] == 230
    assert rec["slo_met"] is False and d["slo_met"] is True  # tpot_p99 0.09 > 0.05
    # study:azure ran but its cell on casestudy was not measured yet (nor aliased)
    assert rows[("casestudy", "win-azure")]["note"].startswith("pending")
    assert rows[("casestudy", "win-mooncake")]["note"] == "study:mooncake not run yet"
    # open loop: capacity, bracket ratios, failed start, alias, open upper end
    ad = rows[("azure", "defaults")]
    assert ad["metric"] == "capacity_rps" and ad["ci_high"] == 44.0
    assert rows[("azure", "recipe")]["status"] == "failed"
    assert "OOM" in rows[("azure", "recipe")]["note"]
    wa = rows[("azure", "win-azure")]
    assert wa["same_as"] == "defaults" and wa["value"] == 40.0
    wc = rows[("azure", "win-casestudy")]
    assert math.isclose(wc["ratio"], 1.25) and math.isclose(wc["ratio_low"], 50 / 44)
    assert wc["ratio_high"] is None
    assert rows[("azure", "win-mooncake")]["status"] == "not measured"
    assert rows[("mooncake", "defaults")]["note"].startswith("pending")


def test_render_markdown_and_csv(tmp_path: Path) -> None:
    md, csv_text = matrix.render(_tree(tmp_path))
    assert "not yet measured: study:mooncake not run yet" in md
    assert "15,000 tok/s [14,550-15,450], x1.50" in md
    assert "(over SLO)" in md and "(= defaults)" in md and "capped" in md
    assert "| casestudy | throughput" in md and "not run yet" in md  # studies table
    lines = csv_text.strip().splitlines()
    assert lines[0].startswith("shape,config,status,metric,value") and len(lines) == 16


def test_lookups_for_resume(tmp_path: Path) -> None:
    r = _tree(tmp_path)
    later = tmp_path / "resumed"
    _w(later / "cross-azure" / "win-mooncake.json", _cap(45.0, 48.0))
    # a result in any searched folder counts; the killed bench's .part does not
    assert steps.cell_result("azure", "win-mooncake", [r]) is None
    assert steps.cell_result("azure", "win-mooncake", [later, r])[0] == "json"
    assert steps.cell_result("azure", "win-azure", [r]) == ("same", "defaults")
    assert steps.cell_result("azure", "recipe", [r])[1]["ok"] is False  # failed = done
    assert steps.study_dir("casestudy", [later, r]) == r / "study-casestudy"
    assert steps.study_dir("mooncake", [later, r]) is None
    # cross benches of an open loop start below the defaults' capacity in its study
    assert steps.capacity_start("azure", [r]) == round(0.75 * 40.0 / 5.53, 2)
    assert steps.capacity_start("mooncake", [r]) == steps.shape_cfg("mooncake")["capacity_start"]
    assert steps.config_of("azure", "win-mooncake", [r])["missing"].startswith("study:mooncake")


def test_arguments_per_objective() -> None:
    t = steps.tune_args("azure")
    assert t[t.index("--objective") + 1] == "capacity" and "--capacity-level-s" in t
    t = steps.tune_args("casestudy")
    assert t[t.index("--objective") + 1] == "throughput" and "--measure-max-s" in t
    b = steps.bench_args("mooncake", 3.5)
    assert "--capacity" in b and b[b.index("--capacity-start") + 1] == "3.5"
    assert "--capacity" not in steps.bench_args("casestudy", 1.0)
    expect, limit = steps.cell_seconds("azure")
    assert 0 < expect < limit


def test_cells_are_grouped_by_server_and_fitted_to_the_deadline(tmp_path: Path) -> None:
    a, b = ["--max-model-len", "2048"], ["--max-model-len", "2048", "--max-num-seqs", "64"]
    cells = [_cell(tmp_path, "casestudy", "defaults", a), _cell(tmp_path, "casestudy", "recipe", b),
             _cell(tmp_path, "azure", "defaults", a), _cell(tmp_path, "azure", "win-casestudy", b),
             _cell(tmp_path, "mooncake", "defaults", a)]
    groups = steps.group_cells(cells, 150)
    # one server per flags+env, in the order of its first cell; cells in plan order
    assert [g["label"] for g in groups] == ["defaults", "recipe+win-casestudy"]
    assert [c["key"] for c in groups[0]["cells"]] == ["casestudy", "azure", "mooncake"]
    e = [c["expected_s"] for c in groups[0]["cells"]]
    assert groups[0]["expected_s"] == 150 + sum(e) and groups[0]["first_s"] == 150 + e[0]
    assert groups[0]["limit_s"] == steps.START_LIMIT + sum(c["limit_s"] for c in cells[::2])
    # other env, other server
    assert len(steps.group_cells([cells[0], {**cells[2], "env": {}}], 150)) == 2
    # the cells that fit: one start, then each cell's expected seconds, 30 s to spare
    assert steps.fit_cells([100, 200, 300], 150, 10_000) == 3
    assert steps.fit_cells([100, 200, 300], 150, 150 + 30 + 300) == 2
    assert steps.fit_cells([100, 200, 300], 150, 150 + 30 + 299) == 1
    assert steps.fit_cells([100, 200, 300], 150, 200) == 0
    args = steps.cell_bench_args(cells[1])
    assert args[-5:] == ["--", *b] and args[args.index("--env") + 1] == "E=1"


def test_a_winner_cell_goes_stale_when_its_study_names_another_config(tmp_path: Path) -> None:
    # study:azure judged again (rejudge.py, or a recheck: step) may name another config:
    # win-azure's measured cell, or its CFG.same pointing at the defaults' cell, then no
    # longer counts, and the planner measures the config the study names now
    res = tmp_path / "res"
    (res / "study-azure").mkdir(parents=True)
    (res / "study-azure" / "DONE").touch()
    x, y = ["--max-num-seqs", "1024"], ["--max-num-seqs", "256"]

    def names(flags: list[str]) -> None:
        _w(res / "study-azure" / "best.json", {"flags": flags, "env": {}, "trial": 4})

    _w(res / "cross-casestudy" / "defaults.json", {"ok": True, "flags": x, "env": {}})
    (res / "cross-casestudy" / "win-azure.same").write_text("defaults\n")
    _w(res / "cross-mooncake" / "win-azure.json", {"ok": True, "flags": x, "env": {}})
    names(x)
    assert steps.cell_result("casestudy", "win-azure", [res]) == ("same", "defaults")
    assert steps.cell_result("mooncake", "win-azure", [res])[0] == "json"
    names(y)
    assert steps.cell_result("casestudy", "win-azure", [res]) is None
    assert steps.cell_result("mooncake", "win-azure", [res]) is None


def test_autotune_best_answers_each_done_study_from_the_committed_stores(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 15's "autotune best --shape traffic/<each>.json returns that shape's winner from
    # the committed store": both stores (Optuna and MLflow, copied: a read may migrate a
    # schema) name what each done study's best.json declares, value and flags
    import shutil

    from autotune.cli import main

    stores = tmp_path / "stores"
    shutil.copytree(HERE / "results" / "stores", stores)
    done = 0
    for key, sc in steps.SHAPES["shapes"].items():
        best_p = HERE / "results" / f"study-{key}" / "best.json"
        if not best_p.exists():
            continue
        done += 1
        best = json.loads(best_p.read_text())
        for store in (["--storage", f"sqlite:///{stores / 'autotune.db'}"],):
            capsys.readouterr()
            rc = main(["best", "--shape", str(HERE.parents[1] / sc["shape"]), *store, "--json"])
            got = capsys.readouterr()
            assert rc == 0, (key, store, got.err[-2000:])
            hit = json.loads(got.out)
            assert hit["exact"] and hit["study"] == f"shapes-{key}", (key, store, hit)
            assert hit["value"] == pytest.approx(best["objective"]["value"]), (key, store)
            assert hit["flags"] == best["flags"], (key, store)
            # and the study's verdict with its interval (Optuna: the study's record;
            # MLflow: the study run's tag and ratio metrics)
            sv = hit["study_verdict"]
            assert sv["verdict"] == best["verdict"], (key, store, sv)
            assert sv["ratio_to_defaults"]["median"] == pytest.approx(
                best["ratio_to_defaults"]["median"]), (key, store)
    assert done >= 3  # casestudy, azure and mooncake are committed
    # the text says the verdict; mooncake's, re-checked on fresh servers, says how many starts
    # would show its best ratio at the measured start-to-start spread
    capsys.readouterr()
    assert main(["best", "--shape", str(HERE.parents[1] / "traffic/mooncake-conv-2k.json"),
                 "--storage", f"sqlite:///{stores / 'autotune.db'}"]) == 0
    text = capsys.readouterr().out
    assert "verdict: vLLM's defaults remain best for this shape" in text, text
    assert "add it with --resume --recheck 1" not in text, text
    assert "start-to-start SD" in text and "--recheck-starts" in text, text
