"""A stand-in for the GPU in the cross-evaluation's tests: `dryrun.py cells ...` is cells.py
itself with a stand-in for the server (no server, no GPU; autotune's bench parser checks
every cell's arguments, as on the GPU), writing files of the same names and layout with
made-up numbers (deterministic per config), so cells.py and matrix.py can be checked here.

    python3 experiments/h200-shapes/dryrun.py cells GROUP.json --gpu 0 --log LOG

Numbers it writes are NOT measurements.
"""

from __future__ import annotations

import hashlib
import importlib.util
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


def _shape_rate(path: str) -> float:  # tune's --shape
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


def _fake_runner(specs: list, *, on_outcome=None, on_phase=None) -> list:
    """Stands in for autotune.trial.run_trials_on_one_server: no server; one "start" in the
    log, then per spec made-up numbers (deterministic per flags, env and shape), handed to
    on_outcome one by one, DRY_SLEEP seconds apart. DRY_FAIL_SHAPE=NAME: the cells of the
    shape whose name contains NAME fail (reason crash)."""
    from autotune.trial import TrialOutcome

    log = Path(specs[0].log_path)
    with log.open("a") as f:
        f.write(f"$ dry run: vllm serve {' '.join(specs[0].flags)} (no server)\n")
    outs = []
    for i, s in enumerate(specs):
        time.sleep(float(os.environ.get("DRY_SLEEP", "0.3")))
        cap = s.capacity is not None
        fail = os.environ.get("DRY_FAIL_SHAPE")
        with log.open("a") as f:
            f.write(f"dry run: trial {i} ({s.shape.name}) measured\n")
        o = TrialOutcome(
            number=s.number, ok=True, start_s=0.0 if i else 80.0, compile_s=None if i else 2.0,
            server_reused=bool(i), warmup={"seconds": 20.0, "segments": 3, "converged": True},
            warmup_s=20.0, measure_s=60.0, stop="cap", log_path=s.log_path,
            metrics=_metrics(list(s.flags), dict(s.env), cap, float(s.shape.rate_rps or 0.0)),
            wall_s=0.3,
        )
        if fail and fail in s.shape.name:
            o.ok, o.reason, o.message, o.metrics = False, "crash", "dry run: DRY_FAIL_SHAPE", {}
        outs.append(o)
        if on_outcome is not None:
            on_outcome(o)
    return outs


def cells(argv: list[str]) -> int:
    """cells.py itself (argument parsing by autotune bench's own parser, the files it writes,
    its deadline, SIGTERM) with _fake_runner in place of the server."""
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("h200_shapes_cells", here / "cells.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv, runner=_fake_runner, extra={"dry_run": True})


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
    rechecks = [int(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--recheck"]
    best = {
        "verdict": "winner",
        "verdict_detail": {"winner_number": 1, "baseline_number": 0, "candidate_number": 1},
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
                # the last --recheck given wins, as in autotune's parser
                "settings": {"recheck": rechecks[-1] if rechecks else 1},
            }
        )
    )
    (out / "trials.csv").write_text("number,state\n0,COMPLETE\n1,COMPLETE\n")
    print(f"dry run: study {name} done")
    return 0


if __name__ == "__main__":
    here = Path(__file__).resolve().parent

    spec = importlib.util.spec_from_file_location(
        "experiments_h200_shapes_steps", here / "steps.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["experiments_h200_shapes_steps"] = mod
    args = [a for a in sys.argv[1:] if a != "-v"]
    sys.exit({"tune": tune, "cells": cells}[args[0]](args[1:]))
