"""Helpers shared by tests/integration/test_kernels.py and tests/unit/test_kernels.py."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.kernels import (
    GRID,
    KernelFailure,
    MoeShape,
)
from autotune.traffic import load_shape
from tests.conftest import REPO

# the 30B stand-in's config as committed for the H200 runs (the same file as
# ../shared/reference/models/nemotron3-nano-30b-a3b-mtp/config.json, which a clone may lack)
STAND_IN = REPO / "experiments" / "h200" / "model"


CASESTUDY = REPO / "traffic" / "casestudy-512x512.json"


NANO = MoeShape(experts=128, intermediate=1856, hidden=2688, topk=6, gated=False)


def _tuned_counts(folder: Path) -> set[int]:
    """The token counts a tuning wrote rows for (the file's keys also hold guard keys)."""
    meta = json.loads((folder / "E=128,N=1856,device_name=NVIDIA_H200.results.json").read_text())
    return {int(row["m"]) for row in meta["sizes"]}


def _model(tmp_path: Path, **cfg: object) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


BEST = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
        "num_warps": 4, "num_stages": 4}


def fake_timer(config: dict[str, int], m: int, *, iters: int) -> float:
    """A deterministic landscape: fastest at BEST; BLOCK_SIZE_N 256 with 5 stages does not
    compile; 8 warps with 2 stages 'run out of resources'."""
    if config["BLOCK_SIZE_N"] == 256 and config["num_stages"] == 5:
        raise KernelFailure("compile_error", "CompilationError: at 12:4 ...")
    if config["num_warps"] == 8 and config["num_stages"] == 2:
        raise KernelFailure("out_of_resources", "OutOfResources: shared memory")
    cost = sum(abs(GRID[k].index(config[k]) - GRID[k].index(BEST[k])) for k in BEST)
    return 10.0 + 3.0 * cost + m / 1000


def _space(facts: object) -> object:
    from autotune.space import load_space

    return load_space(REPO / "search_spaces" / "hybrid-mtp.yaml", facts=facts)  # type: ignore[arg-type]


def _bind_kw(tmp_path: Path, timer: object) -> dict[str, object]:
    from autotune.engine import EngineInfo

    return {"model": STAND_IN, "shape_path": CASESTUDY,
            "shape_fingerprint": load_shape(CASESTUDY).fingerprint,
            "cache_dir": tmp_path / "cache", "gpu_name": "NVIDIA H200", "trials": 4,
            "engine": EngineInfo(package="vllm", version="0.26.0", device="cuda"),
            "timers": [timer]}
