"""experiments/h200-shapes/: the cross-evaluation matrix and run.sh's result lookups, on a
small fake result tree (pure logic, standard library; no server, no GPU)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "experiments" / "h200-shapes"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"h200_shapes_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


matrix = _load("matrix")
steps = matrix.steps


def _w(p: Path, obj) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))


def _tput(v: float, half: float, **m) -> dict:
    return {
        "ok": True,
        "start_s": 80.0,
        "warmup": {"seconds": 20.0},
        "measure_s": 75.0,
        "metrics": {
            "output_tokens_per_s": v,
            "output_tokens_per_s_ci_low": v - half,
            "output_tokens_per_s_ci_high": v + half,
            **m,
        },
    }


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
    later = tmp_path / "session2"
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


def test_run_sh_on_one_gpu_measures_the_cells_one_by_one_on_gpu0(tmp_path: Path) -> None:
    # the CPU dry run (DRY=1: dryrun.py stands in for autotune) of a study and its cross
    # cells with GPUS=1: every cell on gpu0, none handed to a second GPU that is not there
    import os
    import subprocess
    import sys

    repo = HERE.parents[1]
    env = dict(os.environ, DRY="1", GPUS="1", STEPS="study:azure cross:azure",
               HOME=str(tmp_path), COMMITTED=str(tmp_path / "none"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    res = tmp_path / "res"
    done = subprocess.run(["bash", str(HERE / "run.sh"), "x", str(res), "900"], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    progress = next(res.glob("session-*/progress.txt")).read_text()
    assert "GPUS=1" in progress
    measured = [line for line in progress.splitlines() if " exit " in line and "cross:" in line]
    assert len(measured) == 3 and all("on gpu0 exit 0" in line for line in measured), progress
    assert "gpu1" not in progress
    assert json.loads((res / "cross-azure" / "step.json").read_text())["gpus"] == 1
