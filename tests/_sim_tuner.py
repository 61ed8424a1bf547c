"""A tuner in its own process, for tests of several tuners sharing one study: the real
``tune()`` on SQLite with a simulated executor (no server) whose trials wait for a file.

``python -m tests._sim_tuner ARGS_JSON`` with ``{"settings": {...TuneSettings},
"heartbeat": {"interval_s", "grace_s"}, "hold": PATH | null, "sleep_s": float,
"ran": PATH | null}``: each trial waits until ``hold`` exists (if given), then sleeps
``sleep_s``, appends its number to ``ran`` (if given) and yields :func:`value`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def value(params: dict[str, Any]) -> dict[str, float]:
    """A made-up measurement of a config (the same in every tuner)."""
    tput = 100.0 + int(params.get("max_num_seqs", 16))
    return {"output_tokens_per_s": tput, "ttft_p99_s": 0.5, "ttft_p50_s": 0.2,
            "error_rate": 0.0, "goodput_rps": tput / 100}


def run(args: dict[str, Any]) -> None:
    from autotune.config import TuneSettings
    from autotune.store import Heartbeat
    from autotune.study import tune
    from autotune.testing import SimulatedExecutor

    hold = Path(args["hold"]) if args.get("hold") else None
    ran = Path(args["ran"]) if args.get("ran") else None

    def evaluate(params: dict[str, Any], spec: Any) -> dict[str, float]:
        while hold is not None and not hold.exists():
            time.sleep(0.05)
        time.sleep(float(args.get("sleep_s", 0.0)))
        if ran is not None:
            with ran.open("a") as f:
                f.write(f"{spec.number}\n")
        return value(params)

    sim = SimulatedExecutor(evaluate)
    tune(TuneSettings(**args["settings"]), executor=sim, tracker=False, callbacks=[sim],
         heartbeat=Heartbeat(**args["heartbeat"]))


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
