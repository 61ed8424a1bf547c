"""Server starts plain and forked from a preloaded interpreter, on the GPU machine.

    python3 experiments/h200-trust/preload-starts.py CONFIGS.json CACHE_DIR OUT_DIR [ROLE]

Starts ROLE's config (default: the defaults) of a study's configs.json four times, one
after the other, each to /health and then stopped: once as ``python -m vllm...`` (what
``autotune bench`` and ``--no-preload`` do), then three times inside a preload scope (the
first of them waits for the launcher's import). Writes OUT_DIR/starts.json: per start its
seconds to healthy, vLLM's start phases and compile seconds (autotune.trial's readers),
the seconds of vLLM's "Initial profiling/warmup run" (the Mamba kernels' warm-up, which
autotunes Triton kernels when TRITON_CACHE_AUTOTUNING is not set), and whether the log says
it was forked. The server logs go to OUT_DIR/logs/.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from autotune.engine import VllmServer, preload_scope
from autotune.engine import _compile_in, _phases_in

MODEL = Path(os.environ.get("MODEL") or Path.home() / "models" / "nemotron3-nano-30b-a3b-mtp")


def start(flags: list[str], env: dict[str, str], cache: Path, log: Path) -> dict:
    server = VllmServer(model=str(MODEL), flags=flags, env=env, log_path=log, gpus=[0],
                        cache_dir=cache, start_timeout_s=420)
    t0 = time.time()
    server.start()
    try:
        healthy = server.wait_healthy()
    finally:
        server.stop()
    data = log.read_bytes()
    text = data.decode("utf-8", "replace")
    warm = [float(x) for x in re.findall(r"Initial profiling/warmup run took ([\d.]+) s", text)]
    return {"log": log.name, "started_at": t0, "start_s": round(healthy, 2),
            "forked": "forked from a preloaded interpreter" in text,
            "compile_s": _compile_in(data), "start_phases": _phases_in(data),
            "profile_warmup_s": warm}


def main() -> None:
    configs = json.loads(Path(sys.argv[1]).read_text())
    cache, out = Path(sys.argv[2]), Path(sys.argv[3])
    role = sys.argv[4] if len(sys.argv) > 4 else "defaults"
    cfg = configs[role]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results = []

    def record(r: dict) -> None:
        results.append(r)
        (out / "starts.json").write_text(json.dumps({"role": role, "flags": cfg["flags"],
                                                     "env": cfg["env"], "starts": results},
                                                    indent=1))
        print(json.dumps(r), flush=True)

    logs = out / "logs"
    record({"kind": "plain", **start(cfg["flags"], cfg["env"], cache, logs / "plain.log")})
    with preload_scope():
        for i in range(3):
            record({"kind": f"preloaded-{i}",
                    **start(cfg["flags"], cfg["env"], cache, logs / f"preloaded-{i}.log")})


if __name__ == "__main__":
    main()
