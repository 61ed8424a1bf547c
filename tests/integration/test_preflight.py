"""Before trial 0: the shape must fit the context (pure parts; no server)."""

from __future__ import annotations

from pathlib import Path

from autotune.traffic import context_overflow, load_shape
from tests._preflight import REPO, _package


def test_shape_clip_cli_makes_the_shape_fit(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "fit.json"
    res = subprocess.run(
        [sys.executable, "-m", "autotune", "shape", "clip",
         str(REPO / "traffic" / "azure-conv.json"), "--max-total-tokens", "2048", "-o", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert res.returncode == 0, res.stderr
    clipped = load_shape(out)
    assert clipped.input_tokens.max + clipped.output_tokens.max <= 2048
    assert context_overflow(clipped, context=2048)[0] == 0


def test_bytecode_check_reads_the_interpreters_flag(tmp_path: Path) -> None:
    """The real flag, in a fresh Python started as the servers are (environment inherited)."""
    import os
    import subprocess
    import sys

    _package(tmp_path)
    code = "from autotune.study import check_bytecode; print(len(check_bytecode('fakevllm')))"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    for flag, expect in (("1", "1"), ("", "0")):
        env["PYTHONDONTWRITEBYTECODE"] = flag
        if not flag:
            del env["PYTHONDONTWRITEBYTECODE"]
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        assert out == [expect]
