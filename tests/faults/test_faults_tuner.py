"""Faults of the tuner itself, and a study that meets every server fault: provoked for real.

Studies run through the real CLI (``autotune tune``) with the real Optuna storage (SQLite),
the real MLflow store (SQLite), real Ray where it says so, and servers that are the fake
engine (``fake_vllm/``) or, for the SIGKILLed tuner, a real vLLM. Signals are real signals
sent to a real tuner process. Each test checks the four promises: the study goes on (or
stops with a clear message and a non-zero exit), no completed trial is lost (read back
from the storage), no process of ours is left (``/proc``), no partial file breaks the
next run (the next run is made).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from autotune.engine import FailureReason
from tests.conftest import needs_vllm
from tests.faults._lab import (
    VERDICT_EXITS,
    Lab,
    check_best_json,
    check_trials_csv,
    file_has,
    kill_tagged,
    run_cli,
    state_of,
    tagged,
    wait_for,
    wait_gone,
    write_space,
)

pytestmark = pytest.mark.faults


def test_study_goes_on_through_every_server_fault(lab: Lab) -> None:
    plan = "ok,exit,hang,fail:3,die:4,stall:4,reject,ok"
    argv = lab.argv(lab.space(plan, AUTOTUNE_FAKE_STALL_S="60"), trials=8,
                    extra=["--start-timeout", "8", "--request-timeout", "3",
                           # a trial now measures until precise (dozens of requests): one
                           # stalled request must still make it infeasible
                           "--max-error-rate", "0.001"])
    rc, out, err = run_cli(argv)
    assert rc in VERDICT_EXITS, err[-3000:]
    assert "Traceback" not in err

    trials = lab.trials()
    assert [state_of(t) for t in trials] == [
        ("COMPLETE", None),                              # served and measured
        ("PRUNED", FailureReason.CRASH),                 # exited during start
        ("PRUNED", FailureReason.START_TIMEOUT),         # never healthy
        ("COMPLETE", "errors"),                          # 1 in 3 requests failed
        ("PRUNED", FailureReason.DIED),                  # SIGKILLed mid-measurement
        ("COMPLETE", "errors"),                          # one stream stalled: cut, counted
        ("PRUNED", FailureReason.INVALID_CONFIG),        # flags refused
        ("COMPLETE", None),
    ]  # fmt: skip
    for t in trials:
        constraints = t.user_attrs["autotune.constraints"]
        if t.state.name == "PRUNED":  # a failure is an infeasible point, never a value of 0
            assert t.value is None and constraints[0] == 1.0 and t.user_attrs["autotune.message"]
        elif t.user_attrs.get("autotune.reason") == "errors":
            assert t.value > 0 and constraints[2] > 0  # measured, but infeasible
        else:
            assert t.value > 0 and all(c <= 0 for c in constraints)
    assert lab.n_launches() == 8
    assert wait_gone(lab.tag, 5) == []

    check_trials_csv(lab.out, trials)
    best = check_best_json(lab.out)
    assert best is not None and best["trial"] in (0, 7)
    assert "8 trials, 2 feasible" in out
    runs = lab.runs()
    children = [r for r in runs if r.data.tags.get("autotune.kind") == "trial"]
    assert len(children) == 8
    reasons = sorted(r.data.tags.get("autotune.failure_reason", "") for r in children)
    assert reasons == sorted(["", "", "crash", "start_timeout", "errors", "died", "errors",
                              "invalid_config"])

    # the report: every failure with the lines of its server log that classified it
    from autotune.report import SECTIONS
    from tests._browser import open_report

    with open_report(lab.out / "report.html") as page:
        assert page.sections() == [*SECTIONS, "config"]
        failures = page.text("#failures")
        for reason in ("crash", "start_timeout", "died", "errors", "invalid_config"):
            assert reason in failures, reason
        assert "error: argument --max-num-seqs: invalid int value" in failures  # from its log
        page.hover_a_point("plot-history")
        assert page.errors == [] and page.requests == []


def test_a_new_study_in_a_used_out_folder_gets_its_own_failure_reasons(lab: Lab) -> None:
    """Two studies with one --out: trial 0 of each writes logs/trial-0000-server.log. The
    second server exits with a plain crash; what the first one printed must not decide
    (or appear in) the second trial's failure."""
    rc, _, err = run_cli(lab.argv(lab.space("reject", "a.yaml"), trials=1))
    assert rc == 1, err[-2000:]  # no feasible trial: exit 1, by design
    assert state_of(lab.trials()[0]) == ("PRUNED", FailureReason.INVALID_CONFIG)

    lab.study = "second"
    rc, _, err = run_cli(lab.argv(lab.space("exit", "b.yaml"), trials=1))
    assert rc == 1, err[-2000:]
    t = lab.trials()[0]
    quoted = "invalid int value" in t.user_attrs["autotune.message"]
    assert (state_of(t), quoted) == (("PRUNED", FailureReason.CRASH), False), (
        "trial 0 of the new study is classified (and explained) with the old study's log: "
        + t.user_attrs["autotune.message"][-600:]
    )


def test_sigint_stops_the_study_cleanly_and_resume_finishes_it(lab: Lab) -> None:
    """Ctrl-C (SIGINT to the tuner's process group) while trial 1 is being measured."""
    space = lab.space("ok,slow,ok", AUTOTUNE_FAKE_CHUNK_S="0.2")
    argv = lab.argv(space, trials=3)
    tuner = lab.spawn(argv, "run1")
    try:
        wait_for(lambda: file_has(lab.log(1), "fake-vllm: request") or tuner.poll() is not None,
                 120, "trial 1 to be measured")
        assert tuner.poll() is None, lab.output("run1")[1][-3000:]
        os.killpg(tuner.pid, signal.SIGINT)
        t0 = time.monotonic()
        rc = tuner.wait(60)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    took = time.monotonic() - t0
    _, err = lab.output("run1")
    assert rc == 130, err[-3000:]
    assert "autotune: interrupted" in err and "Traceback" not in err
    assert took < 30
    assert wait_gone(lab.tag, 5) == []  # the server of trial 1 was stopped
    trials = lab.trials()
    assert [state_of(t) for t in trials] == [("COMPLETE", None), ("FAIL", "interrupted")]
    value0 = trials[0].value
    check_trials_csv(lab.out, trials)
    parent = [r for r in lab.runs() if r.data.tags.get("autotune.kind") == "study"]
    assert [r.info.status for r in parent] == ["KILLED"]

    # The next run: --resume continues the same study and finishes it.
    rc, _, err = run_cli([*argv, "--resume"])
    assert rc in VERDICT_EXITS, err[-3000:]
    trials = lab.trials()
    # The interrupted trial does not count toward --trials: its config runs again.
    assert [state_of(t) for t in trials] == [
        ("COMPLETE", None), ("FAIL", "interrupted"), ("COMPLETE", None), ("COMPLETE", None)]
    assert trials[2].user_attrs.get("autotune.retry_of") == 1
    assert trials[2].params == trials[1].params
    assert trials[0].value == value0
    check_trials_csv(lab.out, trials)
    assert check_best_json(lab.out) is not None
    assert wait_gone(lab.tag, 5) == []


def test_sigterm_under_ray_stops_the_study_cleanly(lab: Lab) -> None:
    """SIGTERM (what systemd, Kubernetes and Slurm send) to a tuner running trials on a
    local Ray: it must stop like Ctrl-C does (exit 130, trial marked interrupted, Ray and
    the server gone), not die from Ray's own signal handler."""
    space = lab.space("ok,slow", AUTOTUNE_FAKE_CHUNK_S="0.2")
    tuner = lab.spawn(lab.argv(space, trials=3, ray=True), "run1")
    try:
        wait_for(lambda: file_has(lab.log(1), "fake-vllm: request") or tuner.poll() is not None,
                 180, "trial 1 to be measured")
        assert tuner.poll() is None, lab.output("run1")[1][-3000:]
        tuner.send_signal(signal.SIGTERM)
        rc = tuner.wait(90)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    _, err = lab.output("run1")
    problems = []
    left = wait_gone(lab.tag, 30)
    if left:
        problems.append(f"left running 30 s after the tuner exited: {[str(p) for p in left]}")
    states = [state_of(t) for t in lab.trials()]
    if states != [("COMPLETE", None), ("FAIL", "interrupted")]:
        problems.append(f"trials in the storage: {states}")
    parent = [r.info.status for r in lab.runs() if r.data.tags.get("autotune.kind") == "study"]
    if parent != ["KILLED"]:
        problems.append(f"MLflow study run status {parent} (expected KILLED)")
    if rc != 130:
        problems.append(f"exit code {rc} (expected 130)")
    if "autotune: interrupted" not in err:
        problems.append("no 'autotune: interrupted' on stderr")
    if "SIGTERM received" in err or "Traceback" in err:
        problems.append("a crash dump on stderr: " + err[err.find("***"):][:300])
    assert not problems, "\n".join(problems)


def test_dead_ray_worker_is_a_failed_trial_and_the_study_goes_on(lab: Lab) -> None:
    """SIGKILL of the Ray worker process that runs trial 1 (what a node's OOM killer or a
    lost node does to a task): the trial comes back as ``worker_died``, its server does not
    outlive the worker, and the study finishes its other trials."""
    space = lab.space("ok,slow,ok", AUTOTUNE_FAKE_CHUNK_S="0.2")
    tuner = lab.spawn(lab.argv(space, trials=3, ray=True), "run1")
    try:
        wait_for(lambda: file_has(lab.log(1), "fake-vllm: request") or tuner.poll() is not None,
                 180, "trial 1 to be measured")
        assert tuner.poll() is None, lab.output("run1")[1][-3000:]
        # the Ray worker running run_trial (Ray titles it "ray::_remote_trial"); the server
        # is its child when started plainly, a preloaded interpreter's when forked
        procs = tagged(lab.tag)
        server = next(p for p in procs if "vllm.entrypoints" in p.args)
        worker = next((p.pid for p in procs if p.args.startswith("ray::_remote_trial")),
                      server.ppid)
        os.kill(worker, signal.SIGKILL)
        rc = tuner.wait(180)
    finally:
        if tuner.poll() is None:
            tuner.kill()
    _, err = lab.output("run1")
    assert rc in VERDICT_EXITS, err[-3000:]
    trials = lab.trials()
    assert [state_of(t) for t in trials] == [
        ("COMPLETE", None), ("PRUNED", "worker_died"), ("COMPLETE", None)], err[-3000:]
    assert "Ray worker" in trials[1].user_attrs["autotune.message"]
    check_trials_csv(lab.out, trials)
    assert check_best_json(lab.out) is not None
    left = wait_gone(lab.tag, 60)
    assert left == [], [str(p) for p in left]  # trial 1's server went with its worker


@needs_vllm
@pytest.mark.slow
def test_tuner_sigkilled_mid_trial_then_resumed(lab: Lab, tiny_llama: Path) -> None:
    """``kill -9`` of a tuner running on a local Ray while trial 1's real vLLM is up (API
    server, engine core and worker processes exist; not waiting for it to be healthy saves
    a minute of CI time).

    Trials 0 and 2 are fake (cheap); trial 1 execs the real vLLM. After the kill: no vLLM
    process may survive (it holds the GPU), Ray's processes must go, trial 0 must be intact
    and trial 1 must not stay RUNNING forever; then --resume (without Ray: what is tested
    there is the study, not Ray) finishes the study."""
    lab.model = tiny_llama
    flags = ("--max-model-len", "1024", "-O0")
    slow = ["--start-timeout", "400", "--request-timeout", "120"]
    space1 = write_space(lab.root / "space1.yaml", plan="ok,real,ok", counter=lab.launches,
                         tag=lab.tag, flags=flags)
    tuner = lab.spawn(lab.argv(space1, trials=3, ray=True, extra=slow), "run1")

    def vllm_is_up() -> bool:  # API server, engine core and its worker all exist
        return (any("VLLM::Worker" in p.args for p in tagged(lab.tag))
                or file_has(lab.log(1), "POST /v1/completions"))

    try:
        wait_for(lambda: vllm_is_up() or tuner.poll() is not None, 400,
                 "the real vLLM of trial 1 to be up", poll_s=0.5)
        assert tuner.poll() is None, lab.output("run1")[1][-3000:]
        before = tagged(lab.tag)
        vllm_groups = {p.pgid for p in before if "vllm.entrypoints" in p.args}
        assert vllm_groups, [str(p) for p in before]
        os.kill(tuner.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        tuner.wait(10)
    finally:
        if tuner.poll() is None:
            tuner.kill()

    # vLLM (API server, engine core, workers: its whole group) must go at once: it holds
    # the GPU. Everything found wrong is collected, so one (expensive) run reports it all.
    problems: list[str] = []

    def vllm_left() -> list[str]:
        return [str(p) for p in tagged(lab.tag) if p.pgid in vllm_groups]

    deadline = time.monotonic() + 30
    while vllm_left() and time.monotonic() < deadline:
        time.sleep(0.25)
    print(f"vLLM group checked {time.monotonic() - killed_at:.1f} s after the tuner's SIGKILL")
    if vllm_left():
        problems.append(
            "30 s after the tuner's SIGKILL, of\n  " + "\n  ".join(str(p) for p in before)
            + "\nthese vLLM processes are still running:\n  " + "\n  ".join(vllm_left()))
    trials = lab.trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "RUNNING"]
    value0 = trials[0].value
    check_trials_csv(lab.out, trials)  # written after trial 0: whole, not half
    assert not (lab.out / "best.json").exists()

    # The next run: --resume, as a second tuner whose processes carry their own tag.
    tag2 = lab.tag + "-resume"
    space2 = write_space(lab.root / "space2.yaml", plan="ok,real,ok", counter=lab.launches,
                         tag=tag2, flags=flags)
    resume = lab.spawn([*lab.argv(space2, trials=3, extra=slow), "--resume"], "run2",
                       AUTOTUNE_FAULT_TAG=tag2)
    try:
        rc = resume.wait(300)
        _, err = lab.output("run2")
        assert rc in VERDICT_EXITS, err[-3000:]
        assert wait_gone(tag2, 30) == []
    finally:
        if resume.poll() is None:
            resume.kill()
        kill_tagged(tag2)
    trials = lab.trials()
    assert [state_of(t) for t in trials] == [
        ("COMPLETE", None), ("FAIL", "tuner_died"), ("COMPLETE", None), ("COMPLETE", None)]
    assert trials[2].user_attrs.get("autotune.retry_of") == 1  # trial 1's config, again
    assert trials[0].value == value0
    check_trials_csv(lab.out, trials)
    assert check_best_json(lab.out) is not None
    parent = [r.info.status for r in lab.runs() if r.data.tags.get("autotune.kind") == "study"]
    assert parent == ["FINISHED"]

    # Ray's processes of the killed tuner must all go too (counted from the kill).
    left = wait_gone(lab.tag, max(0.0, 120 - (time.monotonic() - killed_at)),
                     where=lambda p: p.pgid not in vllm_groups)
    print(f"vLLM processes left: {len(vllm_left())}; Ray's: {len(left)}, "
          f"{time.monotonic() - killed_at:.0f} s after the tuner's SIGKILL")
    if left:
        problems.append(
            f"{time.monotonic() - killed_at:.0f} s after the tuner's SIGKILL these Ray "
            "processes are still running:\n  " + "\n  ".join(str(p) for p in left))
    assert not problems, "\n".join(problems)
