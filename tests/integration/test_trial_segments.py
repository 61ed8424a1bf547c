"""A trial's segmented warm-up and measurement, on the fault suite's fake vLLM.

The fake is a real server process launched by the library exactly as vLLM is (same argv,
process group, log file); it streams at a steady pace, and in mode ``jit:N`` logs vLLM's
kernel-JIT warning on each of its first N requests, as vLLM 0.26 does on a GPU when the
traffic reaches a batch shape its own warm-up did not cover. The CPU build of vLLM logs no
such line (docs/measurement.md), so this is where the JIT rule is tested.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.measure import rate_interval
from autotune.traffic import load_shape
from autotune.trial import TrialOutcome, run_trial
from tests._specs import flat_spec
from tests.conftest import REPO
from tests.faults._lab import FAKE_VLLM, SHAPE


def trial(fake_model: Path, tmp: Path, plan: str, rule: dict[str, float],
          **kw: object) -> TrialOutcome:
    spec = flat_spec(
        number=7, model=str(fake_model), flags=(), shape=load_shape(SHAPE), num_requests=16,
        concurrency=4, segment_requests=8, **rule, start_timeout_s=30,
        env={"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": plan,
             "AUTOTUNE_FAKE_CHUNK_S": "0.004"},
        log_dir=str(tmp), **kw,
    )  # fmt: skip
    return run_trial(spec)


def test_warmup_goes_on_while_the_server_compiles_kernels(fake_model: Path, tmp_path: Path) -> None:
    seen: list[tuple[str, str]] = []
    spec = flat_spec(
        number=3, model=str(fake_model), flags=(), shape=load_shape(SHAPE), num_requests=16,
        concurrency=4, segment_requests=8, precision=0.1, warmup_tolerance=0.2,
        warmup_max_s=30, measure_max_s=10, start_timeout_s=30,
        env={"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": "jit:28",
             "AUTOTUNE_FAKE_CHUNK_S": "0.004"},
        log_dir=str(tmp_path),
    )  # fmt: skip
    out = run_trial(spec, on_phase=lambda n, phase, t, d: seen.append((phase, d)))
    assert out.ok, out.message
    w = out.warmup
    assert w is not None and w["converged"] is True and w["jit_in_last_segment"] is False
    # requests 1..28 logged a compile: the segments that held them (8 requests each, 4 in
    # flight) cannot end the warm-up, however steady the rate already was
    assert w["segments"] >= 4 and w["jit_events"] == 28
    # each warm-up segment's rate is kept (was the system still settling when it ended?)
    assert len(w["rates"]) == w["segments"] and all(r > 0 for r in w["rates"])
    assert out.metrics["warmup_segments"] == w["segments"] and out.metrics["warmup_converged"] == 1
    # the phases the study's display shows: starting, warming up segment by segment (with
    # the compiles), then measuring once
    phases = [p for p, _ in seen]
    assert phases[0] == "starting" and phases.count("measuring") == 1
    assert phases.index("measuring") > phases.index("warming_up")
    warm = [d for p, d in seen if p == "warming_up" and d.startswith("segment ")]
    assert all("kernel was JIT-compiled" in d for d in warm[:3]), warm
    assert out.warmup_s > 0 and out.measure_s > 0 and out.stop in ("precise", "cap")


def test_measurement_stops_when_precise_or_at_its_cap(fake_model: Path, tmp_path: Path) -> None:
    loose = trial(fake_model, tmp_path / "a", "slow", {"precision": 0.2, "measure_max_s": 30})
    assert loose.ok, loose.message
    assert loose.stop == "precise" and 5 <= len(loose.segments) < 12  # 5: the minimum
    m = loose.metrics
    assert (m["output_tokens_per_s_ci_low"] < m["output_tokens_per_s"]
            < m["output_tokens_per_s_ci_high"])
    # the stored interval is the segments' (a t-interval, or log-t when they are skewed,
    # as a loaded machine makes them)
    lo, hi, _ = rate_interval(m["output_tokens_per_s"], loose.segments)
    assert (m["output_tokens_per_s_ci_low"], m["output_tokens_per_s_ci_high"]) == \
        pytest.approx((lo, hi), rel=1e-6)
    # a precision no run reaches: the time cap ends it
    tight = trial(fake_model, tmp_path / "b", "slow",
                  {"precision": 1e-6, "measure_max_s": 3})
    assert tight.ok and tight.stop == "cap" and len(tight.segments) > 3
    # its drift (second half of the segments over the first) is recorded with the figures
    h = len(tight.segments) // 2
    first, second = tight.segments[:h], tight.segments[len(tight.segments) - h:]
    assert tight.metrics["output_tokens_per_s_drift"] == pytest.approx(
        sum(second) / sum(first) - 1, rel=1e-6)
    assert 3 <= tight.measure_s < 15


def test_a_clear_loser_is_pruned_after_two_segments(fake_model: Path, tmp_path: Path) -> None:
    out = trial(fake_model, tmp_path, "slow", {"precision": 1e-6, "measure_max_s": 30},
                incumbent_low=1e9)
    assert out.ok and out.pruned and out.stop == "pruned", out.message
    assert len(out.segments) == 2 and out.measure_s < 10


def test_every_request_failing_in_the_warm_up_is_no_output_not_an_interrupt(
        fake_model: Path, tmp_path: Path) -> None:
    """No segment measured without an interrupt (the abort hook off, every request
    failing): the trial fails for the config (no_output), it is not taken for a stop."""
    out = trial(fake_model, tmp_path, "fail:1", {"precision": 0.2, "measure_max_s": 5},
                abort_failed_fraction=None)
    assert not out.ok and out.reason == "no_output" and out.stop != "interrupted", out.message


def test_two_benches_log_into_one_folder_without_losing_a_measurement(fake_model: Path,
                                                                      tmp_path: Path) -> None:
    log = tmp_path / "logs" / "bench.log"
    cmd = [sys.executable, "-m", "autotune", "bench", "--model", str(fake_model), "--shape",
           str(SHAPE), "--num-requests", "16", "--concurrency", "4", "--precision", "0.2",
           "--measure-max-s", "5", "--warmup-max-s", "5", "--segment-requests", "8",
           "--env", f"PYTHONPATH={FAKE_VLLM}", "--env", "AUTOTUNE_FAKE_PLAN=slow",
           "--env", "AUTOTUNE_FAKE_CHUNK_S=0.004", "--log", str(log), "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
    results = [json.loads(stdout) for stdout, _ in outs]
    assert all(r["ok"] and r["metrics"]["output_tokens_per_s"] > 0 for r in results)
    assert "output_tokens_per_s_ci_low" in results[0]["metrics"]
    assert (results[0]["stagger"], results[0]["output_jitter"]) == (True, 0.1)  # the defaults
    paths = sorted(r["log_path"] for r in results)
    assert paths == sorted([str(log), str(log.with_name("bench-1.log"))])
    for path in paths:  # each server wrote its own log, whole
        text = Path(path).read_text()
        assert text.count("fake-vllm: launch") == 1 and "fake-vllm: serving" in text


def test_sigterm_ends_a_bench_keeping_what_it_measured(fake_model: Path, tmp_path: Path) -> None:
    """A bench stopped by SIGTERM (``timeout`` in a GPU runner, a scheduler) in its second
    repeat prints the first repeat and the whole segments of the second, not nothing."""
    import signal
    import threading
    import time

    log = tmp_path / "bench.log"
    cmd = [sys.executable, "-m", "autotune", "-v", "bench", "--model", str(fake_model),
           "--shape", str(SHAPE), "--num-requests", "16", "--concurrency", "4",
           "--precision", "1e-9", "--measure-max-s", "4", "--warmup-max-s", "3",
           "--segment-requests", "8", "--repeats", "3",
           "--env", f"PYTHONPATH={FAKE_VLLM}", "--env", "AUTOTUNE_FAKE_PLAN=slow",
           "--env", "AUTOTUNE_FAKE_CHUNK_S=0.004", "--log", str(log), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    err: list[str] = []
    first, second = threading.Event(), threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        seen = 0
        for line in proc.stderr:
            err.append(line)
            if " repeat 0: " in line:  # the first repeat is measured: the second runs
                first.set()
            elif first.is_set() and " measured segment " in line:
                seen += 1
                if seen == 2:  # the second repeat measured two segments
                    second.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert second.wait(120), "".join(err)[-3000:]
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout is not None  # stderr is the reader's alone (communicate would race it)
        stdout = proc.stdout.read()  # until the process exits (its JSON fits a pipe)
        proc.wait(60)
        took = time.monotonic() - t_sig
    finally:
        proc.kill()
    reader.join(10)
    text = "".join(err)
    assert proc.returncode == 130, text[-3000:]
    assert "SIGTERM: ending the measurement" in text
    out = json.loads(stdout)
    assert out["ok"] and out["interrupted"] and out["stop"] == "interrupted", out["message"]
    m = out["measurement"]
    assert m["repeats"] == 2 and len(m["repeat_tokens_per_s"]) == 2  # the third never began
    assert all(v > 0 for v in m["repeat_tokens_per_s"]) and out["metrics"]["measure_s"] > 0
    assert "interrupted in repeat 2" in text and took < 30
    assert "fake-vllm: serving" in log.read_text()


def test_sigterm_during_a_benchs_start_stops_it_at_once(fake_model: Path, tmp_path: Path) -> None:
    """Nothing measured yet: SIGTERM stops the bench at once (no wait for the start's
    timeout), exit 130, and the server's whole process group is gone."""
    import re
    import signal
    import time

    log = tmp_path / "bench.log"
    cmd = [sys.executable, "-m", "autotune", "bench", "--model", str(fake_model),
           "--shape", str(SHAPE), "--num-requests", "16", "--concurrency", "4",
           "--start-timeout", "300", "--env", f"PYTHONPATH={FAKE_VLLM}",
           "--env", "AUTOTUNE_FAKE_PLAN=hang", "--log", str(log), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "loading forever" not in (
                log.read_text() if log.exists() else ""):
            time.sleep(0.2)
        found = re.search(r"engine core pid (\d+)", log.read_text())
        assert found, log.read_text()[-2000:]
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - t_sig
    finally:
        proc.kill()
    assert proc.returncode == 130 and "autotune: interrupted" in stderr, stderr[-2000:]
    assert stdout == "" and took < 30
    core = int(found.group(1))
    for _ in range(50):  # the engine core (the server's process group) is stopped with it
        try:
            os.kill(core, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the fake engine core {core} outlived the interrupted bench")


def test_a_server_that_dies_mid_run_ends_the_trial_at_once(fake_model: Path,
                                                           tmp_path: Path) -> None:
    import time

    from autotune.engine import FailureReason

    t0 = time.monotonic()
    out = trial(fake_model, tmp_path, "die:40", {})  # default caps: minutes
    assert (out.ok, out.reason) == (False, FailureReason.DIED), out.message
    assert time.monotonic() - t0 < 30  # every request of a segment failed: stopped


def _capacity_trial(fake_model: Path, tmp: Path, plan: str, rule: dict[str, float],
                    ttft_s: float = 1.0) -> TrialOutcome:
    """A capacity trial on the fake (8 streams of 2-ms chunks at once): the warm-up's
    segments are 1 s of the shape's arrivals at the first level's rate (4 x 5.53 req/s,
    about 22 requests each), the levels 2 s."""
    from autotune.trial import capacity_spec

    spec = flat_spec(
        number=5, model=str(fake_model), flags=(), shape=load_shape(SHAPE),
        slo={"ttft_p99": ttft_s}, **rule, start_timeout_s=30, log_dir=str(tmp),
        env={"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": plan,
             "AUTOTUNE_FAKE_CHUNK_S": "0.002", "AUTOTUNE_FAKE_MAX_RUNNING": "8"},
        **capacity_spec(goodput=0.9, max_error_rate=0.05, start=4.0, tolerance=0.5,
                        level_s=2.0, max_levels=2),
    )
    return run_trial(spec)


def test_a_capacity_warmup_sends_the_levels_traffic_until_no_kernel_compiles(
        fake_model: Path, tmp_path: Path) -> None:
    # The H200's azure cross cell: after a fixed 16-request warm-up at 8 streams, its first
    # level (near capacity) failed on 2 late requests while later, lower ones passed: the
    # first level paid for the compiles. Now the warm-up replays the shape's own arrivals
    # at the first level's rate, segment by segment, while the server logs kernel compiles
    # (requests 1..100 here: the first four seconds), then stops once two agree; the
    # requests still in flight are cancelled, not waited out.
    out = _capacity_trial(fake_model, tmp_path, "jit:100",
                          {"warmup_tolerance": 0.3, "warmup_max_s": 40})
    assert out.ok, out.message
    w = out.warmup
    assert w is not None and w["converged"] is True and w["jit_in_last_segment"] is False
    assert w["segments"] >= 4 and w["jit_events"] >= 90, w
    assert w["rate_rps"] == pytest.approx(22.12, rel=0.01) and len(w["rates"]) == w["segments"]
    assert w["seconds"] < 30  # converged well before the cap
    assert out.metrics["warmup_segments"] == w["segments"] and out.metrics["warmup_converged"] == 1
    levels = out.capacity["levels"] if out.capacity else []
    assert levels and not any(lv["jit_compiled"] for lv in levels)
    assert w["jit_segments_measuring"] == 0


def test_a_capacity_warmup_at_its_cap_says_so_and_levels_record_their_compiles(
        fake_model: Path, tmp_path: Path) -> None:
    # compiles that outlast the warm-up's cap: the warm-up ends unconverged with a compile
    # in its last segment, and each level that still saw one says so (evidence that the
    # capacity may rest on a level that paid for them)
    out = _capacity_trial(fake_model, tmp_path, "jit:100000",
                          {"warmup_tolerance": 0.3, "warmup_max_s": 1.5})
    assert out.ok, out.message
    w = out.warmup
    assert w is not None and w["converged"] is False and w["jit_in_last_segment"] is True
    levels = out.capacity["levels"] if out.capacity else []
    assert levels and all(lv["jit_compiled"] for lv in levels)
    assert w["jit_segments_measuring"] == len(levels)


def test_a_level_that_fails_while_a_kernel_compiles_is_run_once_more(
        fake_model: Path, tmp_path: Path) -> None:
    # a failing level that saw a compile may have failed for the compile, not the load: it
    # runs once more (its own words again), and says so; here every level fails (an SLO no
    # request meets) and every run compiles, so each level runs exactly twice
    out = _capacity_trial(fake_model, tmp_path, "jit:100000",
                          {"warmup_tolerance": 0.3, "warmup_max_s": 1.0}, ttft_s=1e-6)
    levels = out.capacity["levels"] if out.capacity else []
    # the two levels of the search, and the lowest once more before no capacity is called
    assert len(levels) == 3 and all(not lv["passed"] and lv["jit_compiled"] for lv in levels)
    assert all(lv["reruns"] == 1 for lv in levels), levels
    assert [lv.get("remeasured", False) for lv in levels] == [False, False, True]
    assert levels[2]["scale"] == min(lv["scale"] for lv in levels)
    assert all(lv["worst_misses"] for lv in levels), levels  # which requests missed
    # each level says which SLO its misses exceeded (all TTFT here), of the requests that
    # ended before it stopped
    assert all(0 < lv["missed_by"]["ttft"] <= lv["finished"] < lv["offered"]
               and set(lv["missed_by"]) == {"ttft"} for lv in levels), levels


def test_capacity_levels_are_stretched_to_outlast_the_shapes_requests(
        fake_model: Path, tmp_path: Path) -> None:
    # A level starts from an idle server, which fills up for about one request's duration;
    # the H200's mooncake levels (20 s of arrivals, requests of 10-15 s) judged mostly
    # requests served before the server was full. Here requests take ~1.3 s (43 tokens, the
    # shape's median, 30 ms apart) and the levels asked for 2 s: the warm-up measures the
    # request time, and each level then replays 3 of them (~4 s) of arrivals.
    from autotune.trial import LEVEL_SPAN, LevelPlan, capacity_spec

    spec = flat_spec(
        number=6, model=str(fake_model), flags=(), shape=load_shape(SHAPE),
        slo={"ttft_p99": 5.0}, warmup_tolerance=0.3, warmup_max_s=6.0,
        start_timeout_s=30, log_dir=str(tmp_path),
        env={"PYTHONPATH": str(FAKE_VLLM), "AUTOTUNE_FAKE_PLAN": "ok",
             "AUTOTUNE_FAKE_CHUNK_S": "0.03", "AUTOTUNE_FAKE_MAX_RUNNING": "64"},
        **capacity_spec(goodput=0.9, max_error_rate=0.05, start=1.0, tolerance=0.5,
                        level_s=2.0, max_levels=2),
    )
    out = run_trial(spec)
    assert out.ok, out.message
    req_s = (out.warmup or {}).get("request_s")
    assert req_s is not None and 43 * 0.03 * 0.8 < req_s < 43 * 0.03 * 2, out.warmup
    cap = out.capacity or {}
    assert cap["level_s_asked"] == 2.0
    assert cap["level_s"] == pytest.approx(LEVEL_SPAN * req_s, abs=0.1)
    assert cap["level_note"].startswith(f"levels of {cap['level_s']:g} s of arrivals")
    lv = cap["levels"][0]  # 5.53 req/s: passes, all its arrivals sent
    assert lv["finished"] == lv["offered"] and lv["missed_by"] == {}
    # at least the plan's requests, and as many as last the stretched level at the rate of
    # the recording's busiest stretch
    assert lv["passed"] and lv["offered"] >= LevelPlan(level_s=cap["level_s"]).requests(
        lv["offered_rps"])
    assert lv["seconds"] >= 0.8 * cap["level_s"]


