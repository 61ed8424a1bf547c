"""Helpers shared by tests/integration/test_h200_shapes_matrix.py and tests/unit/test_h200_shapes_matrix.py."""

from __future__ import annotations

import importlib.util
import json
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


def _cell(tmp: Path, key: str, cfg: str, flags: list[str]) -> dict:
    return {"key": key, "config": cfg, "flags": flags, "env": {"E": "1"}, "source": "test",
            "args": steps.bench_args(key, 2.0), "expected_s": steps.cell_seconds(key)[0],
            "limit_s": steps.cell_seconds(key)[1], "prefix": str(tmp / f"cross-{key}" / cfg)}
