#!/usr/bin/env python3
"""Stage vLLM (and the project's own runtime dependencies) for an offline GPU host.

The GPU host has Python 3.12, CUDA 13.0 and torch 2.11.0+cu130 preinstalled
(host-packages.txt lists everything it already has) and no package index.
vLLM 0.26.0 is the newest release built against torch 2.11.0, so it is the one
that runs there.

This script, run on a machine that reaches PyPI, resolves the wheels the host
lacks, strips what a Hopper GPU never loads (the FlashAttention-2 binary,
DeepGEMM builds for other Pythons), and splits the lot into parts of at most
--part-mb MB under OUT/p0, OUT/p1, ...  OUT/p0 also holds install.sh.

On the host, copy every part directory's files into one folder, then run
`bash FOLDER/install.sh FOLDER TARGET`; it checks each part's sha256,
installs every wheel into TARGET (default ~/site) and prints the
PYTHONPATH line to use.

Usage:
  python3 make_bundle.py [--out .gpu] [--part-mb 45] [EXTRA_REQUIREMENT ...]
  e.g. python3 scripts/gpu/make_bundle.py --out .gpu optuna ray mlflow
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM = "vllm==0.26.0"
# Packages the host already has at exactly these versions: resolved as stand-ins so
# pip does not pull multi-GB CUDA builds of them.
HOST_PINNED = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0"}
# Large wheels vLLM lists but never imports for dense or hybrid (Mamba) models on Hopper.
SKIP = re.compile(
    r"^(tokenspeed|nvidia[-_]cutlass[-_]dsl[-_]libs[-_]cu1[23]|nvidia[-_]nvvm|nvidia[-_]cuda[-_]nvcc|"
    r"nvidia[-_]cuda[-_]crt|nvidia[-_]cuda[-_]nvdisasm|tilelang|z3[-_]solver|pynvvideocodec|"
    r"torchcodec|sentry[-_]sdk)",
    re.I,
)
# Members of the vLLM wheel that a Hopper GPU on Python 3.12 never loads.
VLLM_STRIP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
]
PLATFORM_ARGS = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
    *sum((["--platform", p] for p in [
        "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
        "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
        "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
        "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64",
        "manylinux1_x86_64", "linux_x86_64"]), []),
]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stand_in_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel that satisfies `name==version` during resolution."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: stand-in\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(
        f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v.encode()).digest()).rstrip(b'=').decode()},{len(v)}\n"
        for k, v in files.items()
    )
    files[f"{dist}/RECORD"] = record + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def resolve(extra: list[str], work: Path) -> list[tuple[str, str]]:
    req = work / "requirements.txt"
    lines = [VLLM, *extra]
    for name, version in HOST_PINNED.items():
        lines.append(f"{name} @ {stand_in_wheel(work, name, version).as_uri()}")
    req.write_text("\n".join(lines) + "\n")
    report = work / "report.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
         *PLATFORM_ARGS, "--target", str(work / "target"), "--report", str(report), "-r", str(req)],
        check=True,
    )
    host = {norm(l.strip()) for l in (HERE / "host-packages.txt").read_text().splitlines()
            if l.strip() and not l.startswith("#")}
    wanted = []
    for item in json.loads(report.read_text())["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if norm(name) in host or SKIP.match(name):
            continue
        wanted.append((name, version))
    return wanted


def download(wanted: list[tuple[str, str]], cache: Path) -> list[Path]:
    cache.mkdir(parents=True, exist_ok=True)
    spec = cache / "download.txt"
    spec.write_text("".join(f"{n}=={v}\n" for n, v in wanted))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS,
         "-d", str(cache), "-r", str(spec)],
        check=True,
    )
    keep = {norm(n) + "-" + v for n, v in wanted}
    wheels = []
    for whl in sorted(cache.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        if norm(name) + "-" + version in keep:
            wheels.append(whl)
    return wheels


def strip_vllm(wheel: Path, out_dir: Path) -> Path:
    stripped = out_dir / wheel.name
    shutil.copy2(wheel, stripped)
    with zipfile.ZipFile(stripped) as z:
        present = [m for m in VLLM_STRIP if m in z.namelist()]
    if present:
        subprocess.run(["zip", "-q", "-d", str(stripped), *present], check=True)
    return stripped


INSTALL_SH = r"""#!/bin/bash
# install.sh FOLDER [TARGET]: reassemble the parts in FOLDER and install every wheel into TARGET.
set -euo pipefail
SRC=${1:?folder holding part-* and MANIFEST}; TARGET=${2:-$HOME/site}
cd "$SRC"
sha256sum -c MANIFEST
cat $(awk '{print $2}' MANIFEST) | tar xf - -C "$SRC"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$SRC"/wheels/*.whl
rm -rf "$SRC"/wheels
echo "installed into $TARGET; use: export PYTHONPATH=$TARGET HF_HUB_OFFLINE=1"
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".gpu", type=Path)
    ap.add_argument("--part-mb", default=45, type=int)
    ap.add_argument("--cache", default=Path.home() / ".cache" / "gpu-bundle", type=Path)
    ap.add_argument("extra", nargs="*", help="extra requirement specs to stage, e.g. optuna ray mlflow")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        wanted = resolve(args.extra, work)
        wheels = download(wanted, args.cache)
        staged = work / "wheels"
        staged.mkdir()
        for whl in wheels:
            if whl.name.startswith("vllm-"):
                strip_vllm(whl, staged)
            else:
                shutil.copy2(whl, staged / whl.name)
        bundle = work / "bundle.tar"
        with tarfile.open(bundle, "w") as tar:
            tar.add(staged, arcname="wheels")
        for old in args.out.glob("p[0-9]*"):
            shutil.rmtree(old)
        size = args.part_mb * 1_000_000
        manifest, index = [], 0
        with open(bundle, "rb") as f:
            while chunk := f.read(size):
                part_dir = args.out / f"p{index}"
                part_dir.mkdir(parents=True)
                name = f"part-{index:02d}"
                (part_dir / name).write_bytes(chunk)
                manifest.append(f"{hashlib.sha256(chunk).hexdigest()}  {name}")
                index += 1
        (args.out / "p0" / "MANIFEST").write_text("\n".join(manifest) + "\n")
        (args.out / "p0" / "install.sh").write_text(INSTALL_SH)
        os.chmod(args.out / "p0" / "install.sh", 0o755)
    total = sum(p.stat().st_size for p in args.out.rglob("part-*"))
    print(f"{len(wheels)} wheels, {total / 1e6:.0f} MB in {index} parts under {args.out}/p0..p{index - 1}")


if __name__ == "__main__":
    main()
