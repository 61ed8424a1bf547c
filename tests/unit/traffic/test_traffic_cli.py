"""``autotune shape fit|show|diff`` through ``autotune.cli.main``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from autotune.cli import main
from tests._traffic_cli import REPO, _run


def test_fit_show_diff(
    azure_path: Path, mooncake_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, m = tmp_path / "azure.json", tmp_path / "mooncake.json"
    rc, out, _ = _run(capsys, "shape", "fit", str(azure_path), "-o", str(a))
    assert rc == 0 and "fitted 2867 requests" in out and a.is_file()
    rc, out, _ = _run(
        capsys,
        "shape",
        "fit",
        str(mooncake_path),
        "-o",
        str(m),
        "--format",
        "mooncake",
        "--mode",
        "closed",
        "--concurrency",
        "16",
        "--requests",
        "64",
    )
    assert rc == 0

    rc, out, _ = _run(capsys, "shape", "show", str(a), "--json")
    summary = json.loads(out)
    assert rc == 0
    assert {"fingerprint", "requests", "duration_s", "rate_rps"} <= set(summary)
    assert summary["requests"] == 2867 and summary["rate_rps"] == pytest.approx(4.78, abs=0.01)
    for key in ("input_tokens", "output_tokens"):
        assert {"mean", "p50", "p99"} <= set(summary[key])
    assert summary["input_tokens"]["p50"] == 1041

    rc, out, _ = _run(capsys, "shape", "show", str(m))
    assert rc == 0 and "closed loop, 16 streams, 64 requests" in out and "cacheable" in out

    rc, out, _ = _run(capsys, "shape", "diff", str(a), str(m), "--json")
    d = json.loads(out)
    assert rc == 1 and d["verdict"] == "drifted" and "input_tokens" in d["dimensions"]
    rc, out, _ = _run(capsys, "shape", "diff", str(a), str(a))
    assert rc == 0 and out.startswith("same:")


def test_shuffled_refit_is_same(
    azure_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = azure_path.read_text().splitlines()
    body = lines[1:]
    random.Random(1).shuffle(body)
    shuffled = tmp_path / "shuffled.csv"
    shuffled.write_text("\n".join([lines[0], *body]) + "\n")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert _run(capsys, "shape", "fit", str(azure_path), "-o", str(a))[0] == 0
    assert _run(capsys, "shape", "fit", str(shuffled), "-o", str(b))[0] == 0
    rc, out, _ = _run(capsys, "shape", "diff", str(a), str(b), "--json")
    d = json.loads(out)
    assert rc == 0 and d["verdict"] == "same" and d["fingerprint_a"] == d["fingerprint_b"]


def test_show_by_name(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    rc, out, _ = _run(capsys, "shape", "show", "casestudy-512x512")
    assert rc == 0 and "no arrival times" in out and "256 streams" in out


def test_bad_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = tmp_path / "t.csv"
    t.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,10,2\n"
        "2023-11-16 18:15:47,10,-3\n2023-11-16 18:15:48,12,4\n"
    )
    rc, out, err = _run(capsys, "shape", "fit", str(t), "-o", str(tmp_path / "o.json"))
    assert rc == 2 and "Traceback" not in err
    assert (
        f"traffic file {t} line 3: 'GeneratedTokens' is -3; token counts must be >= 0 "
        "(fix the row or pass --skip-bad)" in err
    )
    rc, out, err = _run(
        capsys, "shape", "fit", str(t), "-o", str(tmp_path / "o.json"), "--skip-bad"
    )
    assert rc == 0 and "fitted 2 requests" in out
    assert "skipped 1 bad line(s)" in err and "line 3: 'GeneratedTokens' is -3" in err


@pytest.mark.parametrize(
    ("name", "text", "fmt", "what"),
    [
        ("burst.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "0,ChatGPT,10,2,12,Conversation log\n-5,ChatGPT,10,3,13,Conversation log\n"
         "7,ChatGPT,12,4,16,Conversation log\n", "burstgpt", "'Timestamp' is -5"),
        ("log.jsonl", '{"timestamp": 1700000000, "prompt_tokens": 10, "completion_tokens": 2}\n'
         '{"timestamp": -3.5, "prompt_tokens": 10, "completion_tokens": 2}\n', "openai_log",
         "'timestamp' is -3.5"),
        ("moon.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
         '{"timestamp": -250, "input_length": 10, "output_length": 5}\n', "mooncake",
         "'timestamp' is -250"),
    ],
)
def test_a_negative_timestamp_is_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, fmt: str,
        what: str) -> None:
    """A negative arrival time would shift every gap of the fitted shape: refused with the
    row, what is wrong and the fix, not fitted."""
    t = tmp_path / name
    t.write_text(text)
    out_path = tmp_path / "o.json"
    rc, out, err = _run(capsys, "shape", "fit", str(t), "--format", fmt, "-o", str(out_path))
    assert rc == 2 and not out_path.exists(), (out, err)
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"autotune: error: traffic file {t} line ")
    assert what in line and "negative arrival time" in line and "shift the column" in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["shape", "show", "nope.json"], "does not exist; fit one"),
        (["shape", "fit", "nope.csv", "-o", "x.json"], "does not exist"),
        (["shape", "fit", "x.csv", "--mode", "closed"], "--mode closed needs --concurrency"),
        (["shape", "fit", "x.csv", "--requests", "0"], "--requests must be >= 1"),
    ],
)
def test_user_errors(
    argv: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and message in err and "Traceback" not in err


def test_help_explains_options(capsys: pytest.CaptureFixture[str]) -> None:
    for sub in ("fit", "show", "diff"):
        with pytest.raises(SystemExit) as info:
            main(["shape", sub, "--help"])
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "--json" in out or "--skip-bad" in out
    with pytest.raises(SystemExit):
        main(["shape", "fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "leave out malformed lines" in text and "detected from the first line" in text
