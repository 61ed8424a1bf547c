"""Stand-in for `python3 -m autotune tune|bench` in run.sh's CPU dry run (DRY=1): no server,
no GPU; writes files of the same names and layout with made-up numbers (deterministic per
config), so run.sh's steps, skips, resume, cell queue and matrix.py can be checked here.

    DRY=1 STEPS="study:azure cross:azure" HOME=/tmp/h \
      bash experiments/h200-shapes/run.sh x /tmp/h/res 900

Numbers it writes are NOT measurements. The Optuna store gets the study's name only (so that
run.sh's --resume logic sees it); the MLflow store is not written.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
import time
from pathlib import Path


def _opt(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def _num(flags: list[str], env: dict, lo: float, hi: float) -> float:
    h = int(hashlib.sha256(json.dumps([flags, env]).encode()).hexdigest()[:8], 16)
    return lo + (hi - lo) * (h % 1000) / 999


def _shape_rate(path: str) -> float:
    return float(json.loads(Path(path).read_text()).get("rate_rps") or 0.0)


def _metrics(flags: list[str], env: dict, capacity: bool, rate: float) -> dict:
    tps = _num(flags, env, 3000, 15000)
    m = {
        "output_tokens_per_s": tps,
        "output_tokens_per_s_ci_low": tps * 0.96,
        "output_tokens_per_s_ci_high": tps * 1.04,
        "ttft_p99_s": _num(flags, env, 0.1, 2.5),
        "tpot_p99_s": _num(flags[::-1], env, 0.01, 0.06),
        "n_requests": 500.0,
        "n_errors": 0.0,
    }
    if capacity:
        c = rate * _num(flags, env, 3, 12)
        m.update(
            capacity_rps=c,
            capacity_rps_ci_low=c,
            capacity_rps_ci_high=c * 1.09,
            output_tokens_per_s_at_capacity=tps,
            capacity_recorded_rps=rate,
            capacity_scale=c / rate,
            capacity_levels=5.0,
        )
    return m


def bench(argv: list[str]) -> int:
    i = argv.index("--") if "--" in argv else len(argv)
    flags, opts = argv[i + 1 :], argv[:i]
    env = dict(e.split("=", 1) for e in (opts[j + 1] for j, a in enumerate(opts) if a == "--env"))
    shape = _opt(opts, "--shape")
    cap = "--capacity" in opts
    time.sleep(float(os.environ.get("DRY_SLEEP", "0.3")))
    m = _metrics(flags, env, cap, _shape_rate(shape))
    print(
        json.dumps(
            {
                "ok": True,
                "reason": None,
                "flags": flags,
                "env": env,
                "start_s": 80.0,
                "compile_s": 2.0,
                "warmup": {"seconds": 20.0, "segments": 3, "converged": True},
                "measure_s": 60.0,
                "stop": "cap",
                "segments": [],
                "log_path": None,
                "measurement": {},
                "metrics": m,
                "message": "",
                "dry_run": True,
            },
            indent=1,
        )
    )
    return 0


def tune(argv: list[str]) -> int:
    from experiments_h200_shapes_steps import config_of

    shape, out = _opt(argv, "--shape"), Path(_opt(argv, "--out"))
    name, storage = _opt(argv, "--study-name"), _opt(argv, "--storage")
    obj = _opt(argv, "--objective", "throughput")
    out.mkdir(parents=True, exist_ok=True)
    db = storage.removeprefix("sqlite:///")
    con = sqlite3.connect(db)
    con.execute(
        "CREATE TABLE IF NOT EXISTS studies (study_id INTEGER PRIMARY KEY, study_name TEXT)"
    )
    if con.execute("SELECT 1 FROM studies WHERE study_name=?", (name,)).fetchone() is None:
        con.execute("INSERT INTO studies (study_name) VALUES (?)", (name,))
    con.commit()
    con.close()
    if os.environ.get("DRY_FAIL_STUDY") == name:
        print("dry run: this study fails (DRY_FAIL_STUDY)")
        return 1
    key = name.removeprefix("shapes-")
    base = config_of(key, "defaults", [])
    size = {"azure": "1483", "mooncake": "1063"}.get(key, "768")
    cand = {
        "flags": base["flags"] + ["--max-cudagraph-capture-size", size],
        "env": {"OMP_NUM_THREADS": "8"},
    }
    rate = _shape_rate(shape)
    cap = obj == "capacity"
    bm, cm = (
        _metrics(base["flags"], base["env"], cap, rate),
        _metrics(cand["flags"], cand["env"], cap, rate),
    )
    metric = "capacity_rps" if cap else "output_tokens_per_s"
    best = {
        "verdict": "winner",
        "ratio_to_defaults": {
            "median": cm[metric] / bm[metric],
            "ci_low": 0.9 * cm[metric] / bm[metric],
            "ci_high": 1.1 * cm[metric] / bm[metric],
        },
        "params": {"cudagraph_cover_prefill": True},
        "flags": cand["flags"],
        "env": cand["env"],
        "objective": {"name": obj, "metric": metric, "value": cm[metric]},
        "metrics": cm,
        "readings": [cm[metric]],
        "trial": 1,
        "baseline": {"trial": 0, "value": bm[metric], "readings": [bm[metric]], "metrics": bm},
        "study": name,
        "shape": {"path": shape},
        "dry_run": True,
    }
    if cap:
        best["capacity"] = {"capacity_rps": cm[metric], "recorded_rps": rate}
    time.sleep(float(os.environ.get("DRY_SLEEP", "0.3")))
    (out / "best.json").write_text(json.dumps(best, indent=1))
    (out / "study.json").write_text(
        json.dumps(
            {
                "study": name,
                "gpu_time": {
                    "gpu0": {
                        "start_s": 170.0,
                        "warmup_s": 40.0,
                        "measure_s": 300.0,
                        "idle_s": 10.0,
                        "other_s": 5.0,
                    },
                    "gpu1": {
                        "start_s": 160.0,
                        "warmup_s": 45.0,
                        "measure_s": 310.0,
                        "idle_s": 12.0,
                        "other_s": 4.0,
                    },
                },
                "dry_run": True,
            }
        )
    )
    (out / "trials.csv").write_text("number,state\n0,COMPLETE\n1,COMPLETE\n")
    print(f"dry run: study {name} done")
    return 0


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "experiments_h200_shapes_steps", here / "steps.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["experiments_h200_shapes_steps"] = mod
    args = [a for a in sys.argv[1:] if a != "-v"]
    sys.exit({"tune": tune, "bench": bench}[args[0]](args[1:]))
