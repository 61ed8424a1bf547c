"""scripts/gpu/caches.sh: compile caches carried to a fresh GPU machine stay valid for
ninja (FlashInfer builds its JIT ops with it). Real ninja and gcc on a one-file build: the
build is packed, the sources are "installed again" (dated now, as on a fresh machine), the
cache restored; ninja must find nothing to do. The old restore (`tar -m`) rebuilt it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "caches.sh"

pytestmark = pytest.mark.skipif(not (shutil.which("ninja") and shutil.which("gcc")),
                                reason="needs ninja and gcc")


def _build(tmp: Path) -> tuple[Path, Path]:
    site, op = tmp / "site" / "inc", tmp / "cache" / "op"
    site.mkdir(parents=True)
    op.mkdir(parents=True)
    (site / "x.h").write_text("#define X 1\n")
    (site / "x.c").write_text('#include "x.h"\nint f(void) { return X; }\n')
    (op / "build.ninja").write_text(
        "rule cc\n"
        f"  command = gcc -MMD -MF $out.d -I{site} -c $in -o $out\n"
        "  depfile = $out.d\n  deps = gcc\n"
        f"build x.o: cc {site / 'x.c'}\n")
    subprocess.run(["ninja"], cwd=op, check=True, capture_output=True)
    return site, op


def _reinstall(site: Path) -> None:
    """What a fresh machine's install does to the sources: every file dated now."""
    time.sleep(1.1)
    for f in site.iterdir():
        os.utime(f)


def _ninja_would_build(op: Path) -> str:
    out = subprocess.run(["ninja", "-n", "-d", "explain"], cwd=op, check=True,
                         capture_output=True, text=True)
    return "" if "no work to do" in out.stdout else (out.stderr + out.stdout).strip()


def _sh(*args: str | Path) -> str:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], check=True,
                          capture_output=True, text=True).stdout


def test_a_restored_cache_is_up_to_date_for_ninja_on_a_fresh_install(tmp_path: Path) -> None:
    site, op = _build(tmp_path)
    stage = tmp_path / "stage"
    assert "caches packed" in _sh("pack", tmp_path / "cache", stage)
    assert sorted(p.name for p in stage.iterdir()) == ["cache-part-aa"]
    shutil.rmtree(tmp_path / "cache")
    _reinstall(site)

    out = _sh("restore", stage, tmp_path / "cache", tmp_path / "site")
    assert "caches restored" in out
    assert _ninja_would_build(op) == ""
    # the inputs were dated back, the Python files were not (their .pyc check the mtime)
    assert (site / "x.h").stat().st_mtime < time.time() - 86400 * 365


def test_the_old_restore_with_fresh_dates_made_ninja_rebuild(tmp_path: Path) -> None:
    """Why the script exists: `tar -m` dates the outputs after their deps-log entries."""
    site, op = _build(tmp_path)
    stage = tmp_path / "stage"
    _sh("pack", tmp_path / "cache", stage)
    shutil.rmtree(tmp_path / "cache")
    _reinstall(site)
    (tmp_path / "cache").mkdir()
    subprocess.run(f"cat {stage}/cache-part-* | tar xzmf - -C {tmp_path / 'cache'}",
                   shell=True, check=True)
    assert "out of date" in _ninja_would_build(op) or "older than" in _ninja_would_build(op)


def test_python_sources_keep_their_dates(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "m.py").write_text("x = 1\n")
    (site / "k.cuh").write_text("// kernel\n")
    stage = tmp_path / "stage"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "f").write_text("cached")
    _sh("pack", tmp_path / "cache", stage)
    before = (site / "m.py").stat().st_mtime
    _sh("restore", stage, tmp_path / "cache2", site)
    assert (site / "m.py").stat().st_mtime == before
    assert (site / "k.cuh").stat().st_mtime < before - 86400 * 365
    assert (tmp_path / "cache2" / "f").read_text() == "cached"


def test_without_parts_restore_says_so_and_touches_nothing(tmp_path: Path) -> None:
    (tmp_path / "stage").mkdir()
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "k.cuh").write_text("")
    before = (tmp_path / "site" / "k.cuh").stat().st_mtime
    assert "no cache parts" in _sh("restore", tmp_path / "stage", tmp_path / "c",
                                   tmp_path / "site")
    assert (tmp_path / "site" / "k.cuh").stat().st_mtime == before
