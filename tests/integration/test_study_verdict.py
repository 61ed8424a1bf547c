"""The study's pruner, re-check, verdict and GPU-time account, on a simulated executor.

The executor is the study's plug-in point (``tune(executor=...)``); here it runs a
simulated trial whose segment rates are drawn around a known mean per config, and which
stops by the very rule a real trial uses (:class:`autotune.stats.SegmentRule`). Everything
else is real: SQLite Optuna, TPE, MLflow in ``tmp_path``, best.json, study.json. Known
means make both verdicts testable, which CPU vLLM's 2x start-to-start noise cannot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from autotune.measure import SegmentRule, mean_interval
from autotune.trial import TrialOutcome, TrialSpec
from tests._study_verdict import study


def simulated(means: dict[str, float], *, start_cv: float, seg_cv: float = 0.01,
              wall: Callable[[str], float] = lambda key: 1.0,
              compile_s: Callable[[int], float | None] = lambda number: None,
              ) -> Callable[[TrialSpec], TrialOutcome]:
    """A trial: each start draws its level (start_cv), each segment its rate (seg_cv);
    ``compile_s(number)`` seconds of the start (added to it) are vLLM compiling."""

    def run(spec: TrialSpec) -> TrialOutcome:
        flags = list(spec.flags)
        key = (f"seqs={flags[flags.index('--max-num-seqs') + 1]}" if "--max-num-seqs" in flags
               else "defaults")
        rng = np.random.default_rng(1000 + spec.number)
        level = means.get(key, means["other"]) * (1 + rng.normal(0, start_cv))
        rule: SegmentRule = spec.rule
        warm = [level * 0.6, level * 0.98, level, level]  # a ramp, then two steady segments
        n_warm = next(i for i in range(1, 5) if rule.warmup(warm[:i], False, 5.0 * i) == "warm")
        rates: list[float] = []
        while True:
            rates.append(float(rng.normal(level, seg_cv * level)))
            decision = rule.measure(rates, 5.0 * len(rates), spec.incumbent_low)
            if decision != "continue":
                break
        iv = mean_interval(rates)
        assert iv is not None
        value = float(np.mean(rates))
        metrics = {"output_tokens_per_s": value, "output_tokens_per_s_ci_low": iv.low,
                   "output_tokens_per_s_ci_high": iv.high, "error_rate": 0.0,
                   "n_requests": 64.0, "ttft_p99_s": 0.5}
        comp = compile_s(spec.number)
        return TrialOutcome(
            number=spec.number, ok=True, metrics=metrics, segments=rates,
            pruned=decision == "stop_pruned", stop=decision.removeprefix("stop_"),
            start_s=20.0 + (comp or 0.0), compile_s=comp, warmup_s=5.0 * n_warm,
            start_phases={"torch_compile_s": comp} if comp else {},
            measure_s=5.0 * len(rates),
            wall_s=20.0 + (comp or 0.0) + 5.0 * (n_warm + len(rates)) + wall(key),
            hostname="sim",
            warmup={"seconds": 5.0 * n_warm, "segments": n_warm, "converged": True,
                    "jit_in_last_segment": False},
        )  # fmt: skip

    return run


def test_a_real_winner_is_declared_and_clear_losers_are_pruned(tmp_path: Path, fake_model: Path
                                                               ) -> None:
    import optuna
    from mlflow.tracking import MlflowClient
    from optuna.trial import TrialState

    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 800.0}, start_cv=0.01)
    result, out, tracking = study(tmp_path, fake_model, fn)
    best = json.loads((out / "best.json").read_text())
    assert best["verdict"] == "winner" == result.verdict["verdict"]  # type: ignore[attr-defined]
    r = best["ratio_to_defaults"]
    assert 1.0 < r["ci_low"] < r["median"] < r["ci_high"]
    assert r["median"] == pytest.approx(1.2, rel=0.05)
    assert best["params"]["max_num_seqs"] == 8 and "--max-num-seqs 8" in best["serve_command"]

    trials = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db").trials
    # the pruner: sampled configs 20 % below the incumbent were cut after 2 segments, as
    # PRUNED trials with their segment rates as intermediate values and no constraint
    # violated (TPE ranks them after every complete trial)
    pruned = [t for t in trials if t.user_attrs.get("autotune.reason") == "pruned"]
    assert pruned, [(t.number, t.user_attrs.get("autotune.reason")) for t in trials]
    for t in pruned:
        assert t.state == TrialState.PRUNED and t.user_attrs["autotune.state"] == "pruned"
        assert len(t.intermediate_values) == 2
        assert all(v == 0 for v in t.user_attrs["autotune.constraints"])
    assert result.failures_by_reason.get("pruned") == len(pruned)  # type: ignore[attr-defined]
    # the defaults and re-check trials are never pruned; the re-check started each of the
    # leader and the defaults twice, fresh
    rechecks = [t for t in trials if "autotune.recheck_of" in t.user_attrs]
    assert sorted(t.user_attrs["autotune.recheck_of"] for t in rechecks) == [0, 0, 1, 1]
    assert all(t.state == TrialState.COMPLETE for t in rechecks)
    assert trials[0].state == TrialState.COMPLETE
    # complete trials carry their segments too
    assert all(t.intermediate_values for t in trials if t.state == TrialState.COMPLETE)
    assert "output_tokens_per_s_ci_low" in trials[0].user_attrs["autotune.metrics"]
    assert trials[0].user_attrs["autotune.warmup"]["converged"] is True

    # the GPU-time account: per slot, in study.json and MLflow
    summary = json.loads((out / "study.json").read_text())
    acct = summary["gpu_time"]["cpu:sim"]
    assert set(acct) == {"start_s", "warmup_s", "measure_s", "idle_s", "other_s", "compile_s"}
    assert acct["start_s"] == 20.0 * len([t for t in trials if t.user_attrs.get("autotune.time")])
    assert acct["measure_s"] > 0 and acct["idle_s"] >= 0
    assert summary["verdict"]["verdict"] == "winner"
    assert summary["verdict"]["winner_number"] == 1 and summary["verdict"]["baseline_number"] == 0
    csv = (out / "trials.csv").read_text().splitlines()[0]
    assert "metric.output_tokens_per_s_ci_low" in csv

    client = MlflowClient(tracking_uri=tracking)
    exp = client.get_experiment_by_name("autotune")
    parent = next(r for r in client.search_runs([exp.experiment_id])
                  if r.data.tags.get("autotune.kind") == "study")
    assert parent.data.tags["autotune.verdict"] == "winner"
    assert parent.data.metrics["ratio_to_defaults_ci_low"] == pytest.approx(r["ci_low"])
    assert parent.data.metrics["gpu_time.cpu:sim.measure_s"] == acct["measure_s"]

    # the report reads what the study recorded: the verdict, the GPU-time account and
    # each measured trial's interval
    from autotune.report import load_report_data

    d = load_report_data(storage=f"sqlite:///{tmp_path}/optuna.db", study_name="sim",
                         out_dir=out)
    assert d.verdict_source == "recorded" and d.verdict is not None
    assert d.verdict["verdict"] == "winner" and d.verdict["ratio_to_defaults"] == r
    assert d.gpu_time_source == "recorded" and d.gpu_time == summary["gpu_time"]
    assert d.feasible and all(t.interval is not None for t in d.feasible)
    assert {t.number for t in d.trials if t.state == "pruned"} == {t.number for t in pruned}
    html = (out / "report.html").read_text()
    assert "trial #1 beats vLLM&#x27;s defaults" in html or "trial #1 beats vLLM's" in html
    assert f"{r['median']:.3f}x" in html  # as the summary's verdict line prints it


def test_a_gap_within_the_noise_leaves_the_defaults_best(tmp_path: Path, fake_model: Path) -> None:
    # 2 % better on average, but server starts differ by 4 %: not shown to be better
    fn = simulated({"defaults": 1000.0, "seqs=8": 1020.0, "other": 700.0}, start_cv=0.04)
    result, out, _ = study(tmp_path, fake_model, fn, pruner="none")
    best = json.loads((out / "best.json").read_text())
    assert best["verdict"] == "defaults_best"
    r = best["ratio_to_defaults"]
    assert r["ci_low"] < 1.0 < r["ci_high"]
    # the serve command is the defaults' (no searched flag), and the best ratio found is
    # reported with the config that reached it
    assert best["is_baseline"] is True and "--max-num-seqs" not in best["serve_command"]
    assert best["verdict_detail"]["candidate_params"]["max_num_seqs"] == 8
    assert (out / "serve_command.sh").read_text().count("--max-num-seqs") == 0
    assert "pruned" not in result.failures_by_reason  # type: ignore[attr-defined]


def test_a_budget_keeps_room_for_the_recheck_and_ends_with_the_verdict(tmp_path: Path,
                                                                      fake_model: Path) -> None:
    import optuna

    # The defaults and the enqueued config report about 45 s of wall time each, sampled
    # configs about 100 s: the re-check's 4 trials (leader and defaults, 2 starts each)
    # at the mean trial time soon do not fit a 300 s budget, so the search stops early,
    # its queue is left alone, and the study still ends with its verdict.
    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 800.0}, start_cv=0.01,
                   wall=lambda key: 60.0 if key.startswith("seqs=") and key != "seqs=8" else 0.0)
    _, out, _ = study(tmp_path, fake_model, fn, timeout_s=300.0)
    trials = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db").trials
    search = [t for t in trials if "autotune.recheck_of" not in t.user_attrs]
    assert 2 <= len(search) < 6  # cut short by the budget
    rechecks = [t for t in trials if "autotune.recheck_of" in t.user_attrs]
    assert sorted(t.user_attrs["autotune.recheck_of"] for t in rechecks) == [0, 0, 1, 1]
    best = json.loads((out / "best.json").read_text())
    assert best["verdict"] == "winner" and best["ratio_to_defaults"]["ci_low"] > 1


@pytest.mark.parametrize("logged", [True, False])
def test_the_budget_rule_leaves_first_start_compiles_out_of_the_recheck_estimate(
        tmp_path: Path, fake_model: Path, logged: bool) -> None:
    import optuna

    # Each search trial's start compiles for 250 s (a first start of its flags on a GPU);
    # the re-check's starts load the compile cache. Re-checking 2 configs x 2 starts at
    # ~300 s a trial would not fit a 600 s budget after the defaults, at ~50 s it does.
    # When the server log states the compile seconds (``logged``), the rule leaves them
    # out and the search runs all 3 trials; the same seconds unexplained count in full.
    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 800.0}, start_cv=0.01,
                   wall=lambda key: 0.0 if logged else 250.0,
                   compile_s=lambda n: 250.0 if logged and n < 3 else None)
    _, out, _ = study(tmp_path, fake_model, fn, timeout_s=600.0, trials=3)
    trials = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db").trials
    search = [t for t in trials if "autotune.recheck_of" not in t.user_attrs
              and "autotune.time" in t.user_attrs]  # started (measured or pruned)
    acct = json.loads((out / "study.json").read_text())["gpu_time"]["cpu:sim"]
    if logged:
        assert len(search) == 3
        assert acct["compile_s"] == 750.0 and acct["start_s"] >= 750.0
        assert trials[0].user_attrs["autotune.time"]["compile_s"] == 250.0
        assert trials[0].user_attrs["autotune.time"]["start_phases"] == {"torch_compile_s": 250.0}
    else:
        assert len(search) == 1 and acct["compile_s"] == 0.0


def test_when_every_other_config_is_pruned_the_verdict_still_gives_the_best_ratio_found(
        tmp_path: Path, fake_model: Path) -> None:
    from autotune.cli._tune import _verdict_line

    # The enqueued config runs at 0.7x the defaults: the pruner stops it, so no other config
    # is measured feasible; the verdict still states its ratio (within-run) and says how.
    fn = simulated({"defaults": 1000.0, "seqs=8": 700.0, "other": 690.0}, start_cv=0.01)
    _, out, _ = study(tmp_path, fake_model, fn, trials=2)
    best = json.loads((out / "best.json").read_text())
    assert best["verdict"] == "defaults_best"
    d = best["verdict_detail"]
    assert d["candidate_pruned"] is True and d["candidate_number"] == 1
    r = best["ratio_to_defaults"]
    assert r is not None and r["ci_high"] < 1 and 0.6 < r["median"] < 0.8
    assert "pruner stopped" in d["reason"]
    line = _verdict_line(json.loads((out / "study.json").read_text())["verdict"])
    assert "trial 1 (pruned as a clear loser" in line and "0.7" in line, line
    # fresh starts of the defaults alone could not change that verdict: none were spent
    # (on the H200 such a re-check cost a 240-s start, experiments/h200-shapes mooncake)
    import optuna

    trials = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db").trials
    assert len(trials) == 2 and not any("autotune.recheck_of" in t.user_attrs for t in trials)


def test_when_every_config_is_rechecked_the_search_readings_count_too(
        tmp_path: Path, fake_model: Path) -> None:
    # Two configs (the defaults and one enqueued), both re-checked once: nothing was picked
    # for being high, so each search reading is a second start and the ratio's interval
    # pools their between-start variance instead of falling back to within-run intervals.
    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 800.0}, start_cv=0.01)
    _, out, _ = study(tmp_path, fake_model, fn, trials=2, recheck_starts=1)
    d = json.loads((out / "best.json").read_text())["verdict_detail"]
    assert len(d["readings"]["candidate"]) == 2 and len(d["readings"]["defaults"]) == 2
    assert d["method"].startswith("delta method") and "df=2" in d["method"]
    # a third config measured but not re-checked: it was passed over, so the winner's
    # readings are the fresh ones only (the winner's curse); one fresh start each measures
    # no start-to-start spread, so it is pooled over each config's search and fresh
    # readings (the H200's azure study: 15.6 then 18.6 req/s for one config, whose
    # capacity bracket alone had claimed [1.45, 1.64])
    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 1100.0}, start_cv=0.01)
    _, out, _ = study(tmp_path / "3", fake_model, fn, trials=3, recheck_starts=1, pruner="none")
    d = json.loads((out / "best.json").read_text())["verdict_detail"]
    assert len(d["readings"]["candidate"]) == 1 and len(d["readings"]["defaults"]) == 1
    assert d["method"].startswith("delta method") and "df=2" in d["method"], d["method"]
    assert "search readings included" in d["method"] and d["start_spread"] is not None
    # two fresh starts each: the estimate stays fresh-only and the spread still pools every
    # start, search readings included (df 4: three starts of each of the two, not the fresh
    # starts' 2; the H200's azure study re-checked with --recheck-starts 2: df 2 had given
    # [0.82, 3.15], df 4 [1.02, 2.55])
    _, out, _ = study(tmp_path / "5", fake_model, fn, trials=3, recheck_starts=2, pruner="none")
    d = json.loads((out / "best.json").read_text())["verdict_detail"]
    assert len(d["readings"]["candidate"]) == 2 and len(d["readings"]["defaults"]) == 2
    assert "df=4" in d["method"] and "search readings included" in d["method"], d["method"]
    # the same study with a 10 % start-to-start spread: the within-run intervals (1 %)
    # would have declared a winner from one fresh start each; the pooled spread does not
    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 1100.0}, start_cv=0.10)
    _, out, _ = study(tmp_path / "4", fake_model, fn, trials=3, recheck_starts=1, pruner="none")
    v = json.loads((out / "study.json").read_text())["verdict"]
    r = v["ratio_to_defaults"]
    assert r["ci_high"] / r["ci_low"] > 1.3, v


def test_a_gain_the_starts_cannot_show_says_how_many_starts_would(
        tmp_path: Path, fake_model: Path) -> None:
    # A 6 % better config under a 5 % start-to-start spread, two starts each (the H200 at
    # 256 streams had 1.094x, [0.847, 1.412]): not shown, so the defaults remain best, and
    # the verdict says how many starts of each would show it at that spread, as the
    # --recheck-starts to ask for (each search reading counts: every config is re-checked).
    from mlflow.tracking import MlflowClient

    from autotune.cli._tune import _verdict_line

    fn = simulated({"defaults": 1000.0, "seqs=8": 1060.0, "other": 800.0}, start_cv=0.05)
    _, out, tracking = study(tmp_path, fake_model, fn, trials=2, recheck_starts=1)
    v = json.loads((out / "study.json").read_text())["verdict"]
    r = v["ratio_to_defaults"]
    assert v["verdict"] == "defaults_best" and r["ci_low"] < 1 < r["median"], v
    need = v["starts_needed"]
    assert need["per_config"] >= 3 and need["recheck_starts"] == need["per_config"] - 1
    assert 0 < v["start_spread"] < 0.5
    assert f"about {need['per_config']} starts of each config" in v["reason"]
    line = _verdict_line(v)
    assert f"--resume --recheck-starts {need['recheck_starts']}" in line, line
    best = json.loads((out / "best.json").read_text())
    assert best["verdict_detail"]["starts_needed"] == need
    client = MlflowClient(tracking_uri=tracking)
    exp = client.get_experiment_by_name("autotune")
    assert exp is not None
    parent = next(r for r in client.search_runs([exp.experiment_id])
                  if r.data.tags.get("autotune.kind") == "study")
    assert parent.data.metrics["starts_needed_per_config"] == need["per_config"]
    # acting on it: the same study resumed with that --recheck-starts adds the missing
    # fresh starts of the two configs (nothing else runs) and judges again
    _, out, _ = study(tmp_path, fake_model, fn, trials=2, resume=True,
                      recheck_starts=need["recheck_starts"])
    again = json.loads((out / "study.json").read_text())["verdict"]
    assert len(again["readings"]["candidate"]) == need["per_config"]
    assert len(again["readings"]["defaults"]) == need["per_config"]
    assert again["verdict"] in ("winner", "defaults_best") and again["ratio_to_defaults"]
    # a winner, or a config slower than the defaults, needs no such count
    fn = simulated({"defaults": 1000.0, "seqs=8": 1200.0, "other": 800.0}, start_cv=0.01)
    _, out, _ = study(tmp_path / "w", fake_model, fn, trials=2, recheck_starts=1)
    v = json.loads((out / "study.json").read_text())["verdict"]
    assert v["verdict"] == "winner" and v["starts_needed"] is None


def test_a_study_searched_without_its_recheck_gets_it_on_resume(tmp_path: Path,
                                                                 fake_model: Path) -> None:
    # a time budget that holds the search or the re-check, not both (experiments/h200-shapes,
    # mooncake on one GPU): --recheck 0 first (one start each, within-run interval), then
    # `--resume --recheck 1 --recheck-starts 1` with the same trials adds one fresh start
    # of the leader and of the defaults, runs no new search trial, and judges again
    import optuna

    from autotune.measure import WITHIN_RUN_ONLY

    fn = simulated({"defaults": 1000.0, "seqs=8": 2000.0, "other": 800.0}, start_cv=0.02)
    first, out, _ = study(tmp_path, fake_model, fn, trials=2, recheck=0)
    v = first.verdict  # type: ignore[attr-defined]
    assert v["method"] == WITHIN_RUN_ONLY and v["candidate_number"] == 1
    # nothing stored on this store: the CPU build's default spread widens it, and says so
    assert "the CPU build's default" in v["prior_spread"]
    # a 2x lead from one start each: unconfirmed, best.json keeps the defaults (issue 66)
    assert v["verdict"] == "unconfirmed" and v["winner_number"] is None
    assert v["confirm_command"].endswith("--study-name sim --resume --recheck 1 "
                                         "--recheck-starts 1")
    assert json.loads((out / "best.json").read_text())["is_baseline"] is True
    st = json.loads((out / "study.json").read_text())
    assert st["settings"]["recheck"] == 0
    again, out, _ = study(tmp_path, fake_model, fn, trials=2, recheck=1, recheck_starts=1,
                          resume=True)
    trials = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db").trials
    assert len(trials) == 4, [t.params for t in trials]  # no new search trial
    assert sorted(t.user_attrs.get("autotune.recheck_of") for t in trials[2:]) == [0, 1]
    v = again.verdict  # type: ignore[attr-defined]
    assert v["method"] != WITHIN_RUN_ONLY and "pooled" in v["method"]
    assert v["verdict"] in ("winner", "defaults_best") and "confirm_command" not in v
    assert json.loads((out / "study.json").read_text())["settings"]["recheck"] == 1


def test_a_one_start_study_widens_its_interval_by_the_spread_an_earlier_study_stored(
        tmp_path: Path, fake_model: Path) -> None:
    # issue 66: a study with repeated starts keeps the start-to-start spread it measured
    # (model, engine, device, host class); a later study of one start each on the same
    # store widens its interval by it and says so
    import optuna

    from autotune.hardware import host_class

    storage = f"sqlite:///{tmp_path}/optuna.db"
    fn = simulated({"defaults": 1000.0, "seqs=8": 1500.0, "other": 800.0}, start_cv=0.05)
    study(tmp_path / "a", fake_model, fn, trials=2, recheck_starts=2, storage=storage,
          study_name="repeated")
    kept = optuna.load_study(study_name="repeated", storage=storage).user_attrs[
        "autotune.start_spread"]
    assert kept["df"] >= 2 and kept["log_sd"] > 0 and kept["host"] == host_class("cpu")
    one, _, _ = study(tmp_path / "b", fake_model, fn, trials=2, recheck=0, storage=storage,
                      study_name="one-start")
    v = one.verdict  # type: ignore[attr-defined]
    spread = math.expm1(kept["log_sd"]) * 100
    assert v["prior_spread"] == (f"start-to-start spread {spread:.1f} % from 1 earlier study "
                                 "on this host"), v
    assert v["verdict"] in ("unconfirmed", "defaults_best")  # one start each: never a winner
    # the interval holds the stored spread: at least the two starts' share of it
    r = v["ratio_to_defaults"]
    assert math.log(r["ci_high"] / r["ci_low"]) >= 2 * 1.9 * math.sqrt(2) * kept["log_sd"]
    assert "autotune.start_spread" not in optuna.load_study(
        study_name="one-start", storage=storage).user_attrs  # nothing measured to keep
