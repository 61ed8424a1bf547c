"""Malformed inputs: traffic files, search spaces, command-line arguments.

Each must end with exit code 2, one clear line ``autotune: error: ...`` that names the
offending file, line, option or value, no traceback, before any server starts and
without leaving a study behind that would block the corrected command. The CLI runs in
this process (as ``python -m autotune`` would run it; one case runs it for real in a
subprocess to pin the exit code and stderr end to end).
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults._lab import SHAPE, Lab, run_cli

pytestmark = pytest.mark.faults

CPU_SPACE = Path(__file__).resolve().parents[2] / "search_spaces" / "cpu.yaml"


def _check_clean_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert lines, err[-2000:]
    for needle in needles:
        assert needle in lines[-1], f"{needle!r} not in {lines[-1]!r}"


# -- traffic files ------------------------------------------------------------------------------

_GOOD = "".join(
    f'{{"timestamp": {i}.0, "usage": {{"prompt_tokens": {10 + i}, "completion_tokens": {5 + i}}}}}\n'
    for i in range(20)
)
_TRACES: dict[str, tuple[bytes, tuple[str, ...]]] = {
    "negative_tokens.jsonl": (
        (_GOOD + '{"timestamp": 30.0, "usage": {"prompt_tokens": 12, "completion_tokens": -3}}\n')
        .encode(), ("line 21", "-3")),
    "nan_tokens.jsonl": (
        (_GOOD + '{"timestamp": 31.0, "usage": {"prompt_tokens": NaN, "completion_tokens": 3}}\n')
        .encode(), ("line 21", "nan")),
    "infinite_time.jsonl": (
        (_GOOD + '{"timestamp": Infinity, "usage": {"prompt_tokens": 3, "completion_tokens": 3}}\n')
        .encode(), ("line 21", "timestamp")),
    "cut_line.jsonl": (
        (_GOOD + '{"timestamp": 32.0, "usage": {"prompt_tok\n').encode(), ("line 21", "JSON")),
    "empty.jsonl": (b"", ("empty",)),
    "binary.jsonl": (bytes(range(256)) * 8, ("UTF-8",)),
    "truncated.jsonl.gz": (gzip.compress(_GOOD.encode() * 20)[:200], ("truncated.jsonl.gz",)),
    "missing_column.csv": (
        b"TIMESTAMP,ContextTokens,Foo\n2023-11-16 18:15:46.6805900,374,44\n",
        ("GeneratedTokens",)),
    "bad_value.csv": (
        (b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
        b"2023-11-16 18:15:47.6805900,abc,44\n"), ("line 3", "abc")),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_TRACES))
def test_malformed_trace_file(name: str, tmp_path: Path) -> None:
    data, needles = _TRACES[name]
    trace = tmp_path / name
    trace.write_bytes(data)
    out = tmp_path / "shape.json"
    rc, _, err = run_cli(["shape", "fit", str(trace), "-o", str(out)])
    _check_clean_error(rc, err, *needles)
    assert not out.exists()  # no half-made shape left behind


def _shape_variant(tmp_path: Path, name: str) -> tuple[Path, tuple[str, ...]]:
    good = json.loads(SHAPE.read_text())
    p = tmp_path / f"{name}.json"
    if name == "not_json":
        p.write_text(SHAPE.read_text()[:300])
        return p, ("not valid JSON",)
    if name == "a_list":
        p.write_text("[1, 2]")
        return p, ("expected a JSON object",)
    if name == "missing":
        return p, ("does not exist",)
    if name == "hand_edited":  # valid numbers, but not what the fingerprint was made from
        good["rate_rps"] = good["rate_rps"] * 2
        p.write_text(json.dumps(good))
        return p, ("fingerprint",)
    if name == "negative_requests":
        good["requests"] = -3
        p.write_text(json.dumps(good))
        return p, ("requests",)
    raise AssertionError(name)


# -- search spaces -----------------------------------------------------------------------------

_KNOB = "  a:\n    type: int\n    low: 1\n    high: 4\n    flag: --max-num-seqs\n"
_SPACES: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "missing": (None, ("not found",)),
    "empty": ("", ("mapping",)),
    "not_yaml": ("name: x\nknobs: [\n", ("not valid YAML",)),
    "unknown_key": ("name: x\nknobs:\n" + _KNOB + "    bogus: 1\n", ("bogus",)),
    "unknown_knob_in_rule": (
        "name: x\nknobs:\n" + _KNOB + "rules:\n  - when: 'b > 2'\n    reason: r\n", ("'b'",)),
    "bad_range": (
        "name: x\nknobs:\n  a:\n    type: int\n    low: 8\n    high: 4\n    flag: --max-num-seqs\n",
        ("low (8) is above high (4)",)),
    "nan_bound": (
        ("name: x\nknobs:\n  a:\n    type: float\n    low: 0.1\n    high: .nan\n"
        "    flag: --gpu-memory-utilization\n"), ("finite",)),
    "unknown_type": ("name: x\nknobs:\n  a:\n    type: quantum\n    flag: --x\n", ("type",)),
    "default_outside": ("name: x\nknobs:\n" + _KNOB + "    default: 9\n", ("default 9",)),
    "condition_on_itself": (
        "name: x\nknobs:\n  a:\n    type: bool\n    flag: --enable-prefix-caching\n    when: a\n",
        ("condition on itself",)),
}  # fmt: skip


def _space_variant(tmp_path: Path, name: str) -> tuple[Path, tuple[str, ...]]:
    text, needles = _SPACES[name]
    p = tmp_path / f"space-{name}.yaml"
    if text is not None:
        p.write_text(text)
    return p, needles


# -- the tune command ----------------------------------------------------------------------------

_ARGS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "slo_unknown_key": (["--slo", "ttft_p98=1"], ("ttft_p98",)),
    "slo_not_a_number": (["--slo", "ttft_p99=fast"], ("fast",)),
    "slo_negative": (["--slo", "ttft_p99=-1"], ("-1",)),
    "slo_nan": (["--slo", "ttft_p99=nan"], ("nan",)),
    "slo_no_value": (["--slo", "ttft_p99"], ("ttft_p99", "KEY=SECONDS")),
    "trials_zero": (["--trials", "0"], ("--trials",)),
    "trials_negative": (["--trials", "-2"], ("--trials",)),
    "trials_not_a_number": (["--trials", "abc"], ("--trials", "abc")),
    "enqueue_garbage": (["--enqueue", "{nope"], ("--enqueue", "{nope")),
    "enqueue_list": (["--enqueue", "[1]"], ("--enqueue", "JSON object")),
    "enqueue_null": (["--enqueue", "null"], ("--enqueue",)),
    "enqueue_missing_file": (["--enqueue", "@no-such.json"], ("no-such.json",)),
    "enqueue_unknown_knob": (["--enqueue", '{"warp": 9}'], ("warp",)),
    "enqueue_out_of_range": (["--enqueue", '{"max_num_seqs": 100000}'], ("100000",)),
    "enqueue_wrong_type": (["--enqueue", '{"max_num_seqs": "lots"}'], ("lots",)),
    "enqueue_breaks_a_rule": (
        ["--enqueue", ('{"max_num_seqs": 64, "max_num_batched_tokens": 256, '
                      '"enable_chunked_prefill": false}')], ("--max-num-batched-tokens",)),
    "timeout_negative": (["--timeout", "-5"], ("--timeout",)),
    "start_timeout_zero": (["--start-timeout", "0"], ("--start-timeout",)),
    "request_timeout_zero": (["--request-timeout", "0"], ("--request-timeout",)),
    "repeats_zero": (["--repeats", "0"], ("--repeats",)),
    "max_error_rate_above_one": (["--max-error-rate", "2"], ("--max-error-rate",)),
    "storage_bad_url": (["--storage", "foo://bar"], ("foo://bar",)),
    "resume_nothing": (["--resume"], ("--resume",)),
    "model_without_config": (["--model", "/nonexistent/model"], ("--model", "config.json")),
}  # fmt: skip

_CASES = (
    [("shape", n) for n in ("not_json", "a_list", "missing", "hand_edited", "negative_requests")]
    + [("space", n) for n in sorted(_SPACES)]
    + [("args", n) for n in sorted(_ARGS)]
)


@pytest.mark.parametrize("kind, name", _CASES, ids=[f"{k}-{n}" for k, n in _CASES])
def test_malformed_tune_input(kind: str, name: str, lab: Lab) -> None:
    shape, space, extra = SHAPE, CPU_SPACE, []
    if kind == "shape":
        shape, needles = _shape_variant(lab.root, name)
    elif kind == "space":
        space, needles = _space_variant(lab.root, name)
    else:
        extra, needles = _ARGS[name]
    argv = lab.argv(space, trials=2, extra=extra)
    argv[argv.index("--shape") + 1] = str(shape)
    rc, _, err = run_cli(argv)
    _check_clean_error(rc, err, *needles)
    if kind == "args" and extra[0] != "--storage":
        # the message names the option as the user typed it (not an internal field name)
        flag = extra[0]
        assert re.search(rf"{re.escape(flag)}(?![\w-])", err), err.strip().splitlines()[-1]
    _check_no_study(lab)


def _check_no_study(lab: Lab) -> None:
    import optuna

    db = lab.root / "optuna.db"
    if db.exists():
        assert optuna.get_all_study_summaries(lab.storage, include_best_trial=False) == []
    assert lab.n_launches() == 0


def test_contradictory_rules_are_refused_before_any_server_starts(lab: Lab) -> None:
    """Rules that exclude the whole space are knowable from the YAML alone: refuse them at
    once (exit 2), not after the baseline trial and 200 rejected samples."""
    space = lab.space("ok")
    space.write_text(space.read_text() + (
        "rules:\n  - when: 'max_num_seqs >= 1'\n    reason: every config is forbidden\n"))
    rc, took = lab.run_bounded(lab.argv(space, trials=3), "run", 30)
    _, err = lab.output("run")
    problems = []
    if lab.n_launches():
        problems.append(f"{lab.n_launches()} server(s) started for a space that allows nothing")
    if rc is None:
        problems.append(f"no verdict after {took:.0f} s")
    elif rc != 2 or "Traceback" in err or "every config is forbidden" not in err:
        problems.append(f"exit {rc}: {err.strip().splitlines()[-1:]}")
    assert not problems, "\n".join(problems)
    _check_no_study(lab)


def test_malformed_input_end_to_end_exit_code_and_stderr(lab: Lab) -> None:
    """The same mapping through the real entry point: exit status 2, one error line."""
    argv = lab.argv(CPU_SPACE, trials=0)
    proc = subprocess.run([sys.executable, "-m", "autotune", *argv], capture_output=True,
                          text=True, timeout=120, cwd=lab.root, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autotune: error: --trials"), proc.stderr
    assert proc.stdout == ""
