"""shape plot: the plots of a shape (the rest of the shape CLI: tests/unit/traffic/test_traffic_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._traffic_cli import REPO, _run


def test_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, _ = _run(
        capsys,
        "shape",
        "show",
        str(REPO / "traffic" / "example-chat.json"),
        "--plots",
        str(tmp_path / "plots"),
    )
    assert rc == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == [
        "example-chat-arrival_rate.png",
        "example-chat-input_tokens.png",
        "example-chat-output_tokens.png",
    ]
    assert all((tmp_path / "plots" / n).read_bytes()[:4] == b"\x89PNG" for n in pngs)
