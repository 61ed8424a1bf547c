"""The rollout's pure parts: the step plan, quantile intervals from histograms, the judge."""

from __future__ import annotations

from typing import Any


def test_cli_errors_are_one_line_and_change_nothing(tmp_path: Any, capsys: Any) -> None:
    from autotune.cli import main
    from autotune.engine import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    base = ["rollout", "--router", dead, "--out", str(tmp_path / "r"), "--no-mlflow"]
    assert main([*base, "--new", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "--router" in err and len(err.splitlines()) == 1
    assert main([*base, "--start"]) == 2
    assert "--start needs --best" in capsys.readouterr().err
    assert main([*base, "--new", "http://x:1", "--tolerance", "-1"]) == 2
    assert "--tolerance" in capsys.readouterr().err
    assert main([*base, "--new", "http://x:1", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
