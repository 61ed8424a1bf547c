"""The whole study loop in process: real Optuna (SQLite), the real loop and result files,
a simulated executor instead of vLLM servers (seconds, not minutes)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
import pytest

from autotune.config import TuneSettings
from autotune.events import StudyCallback, StudyContext, StudyEvent, TrialRecord
from autotune.records import BestFile
from autotune.store import A, FailureReason, n_finished
from autotune.study import tune
from autotune.testing import SimulatedExecutor
from autotune.trial import TrialOutcome, TrialSpec
from tests.conftest import REPO


def _value(params: dict[str, Any], spec: TrialSpec) -> dict[str, float] | str:
    seqs = int(params.get("max_num_seqs", 16))
    if seqs > 48:
        return FailureReason.OOM  # a config that cannot start
    tput = 100.0 + seqs + (10.0 if params.get("enable_chunked_prefill") else 0.0)
    return {"output_tokens_per_s": tput, "ttft_p99_s": 0.5, "ttft_p50_s": 0.2,
            "error_rate": 0.0, "goodput_rps": tput / 100}


class Recorder(StudyCallback):
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_study_start(self, event: StudyEvent, context: StudyContext) -> None:
        self.calls.append(("study_start", context.study_name))

    def on_trial_start(self, event: StudyEvent) -> None:
        self.calls.append(("trial_start", event.trial_number))

    def on_trial_phase(self, number: int, phase: str, elapsed_s: float, detail: str) -> None:
        self.calls.append(("phase", (number, phase)))

    def on_trial_end(self, event: StudyEvent, record: TrialRecord) -> None:
        self.calls.append(("trial_end", (record.number, record.state, record.rejected)))

    def on_study_end(self, event: StudyEvent, result: Any) -> None:
        self.calls.append(("study_end", result))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 1000, "max_position_embeddings": 2048}))
    return d


def _settings(model: Path, tmp_path: Path, **kw: Any) -> TuneSettings:
    base: dict[str, Any] = {
        "model": model, "shape": REPO / "traffic" / "example-chat.json",
        "space": REPO / "search_spaces" / "cpu.yaml", "trials": 8, "seed": 1, "recheck": 2,
        "storage": f"sqlite:///{tmp_path}/optuna.db", "study_name": "sim",
        "out": tmp_path / "out", "quality_probe": False, "use_ray": False}
    base.update(kw)
    return TuneSettings(**base)


def test_a_whole_study_with_a_simulated_executor(model: Path, tmp_path: Path) -> None:
    sim = SimulatedExecutor(_value, slots=2)
    rec = Recorder()
    result = tune(_settings(model, tmp_path), executor=sim, tracker=False,
                  callbacks=[sim, rec])

    study = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = study.get_trials()
    searched = [t for t in trials if A.RECHECK_OF not in t.user_attrs
                and t.user_attrs.get(A.REASON) != "rejected"]
    assert len(searched) == 8 and searched[0].user_attrs[A.BASELINE] is True
    rechecks = [t for t in trials if A.RECHECK_OF in t.user_attrs]
    assert 1 <= len(rechecks) <= 3 * 2  # the top 2 and the baseline, on 2 fresh starts each
    assert n_finished(study) == 8 + len(rechecks)
    for t in trials:
        if t.params.get("max_num_seqs", 0) > 48 and t.user_attrs.get(A.REASON) != "rejected":
            assert t.state.name == "PRUNED" and t.user_attrs[A.REASON] == "oom"
            assert t.constraints["failed"] == 1.0

    # best.json: the best measured config, its command, and the other result files
    best = json.loads((tmp_path / "out" / "best.json").read_text())
    assert result.best is not None and result.best.to_json() == best
    assert BestFile.load(tmp_path / "out") == result.best  # round-trips through its model
    ok = [t for t in trials if t.user_attrs.get(A.STATE) == "ok"]
    # the verdict rests on the fresh-server readings of the declared config (the re-check)
    same = [t for t in ok if t.params == best["params"]
            and bool(t.user_attrs.get(A.BASELINE)) == best["is_baseline"]]
    fresh = [t.value for t in same if A.RECHECK_OF in t.user_attrs]
    assert sorted(best["readings"]) == sorted(fresh or [t.value for t in same])
    assert best["objective"]["value"] == statistics.median(best["readings"])
    assert best["verdict"] in ("winner", "defaults_best") and best["ratio_to_defaults"]
    assert best["serve_command"].startswith("vllm serve ")
    # the defaults' reading the verdict used (a fresh start when they were re-checked)
    assert trials[best["baseline"]["trial"]].user_attrs[A.BASELINE] is True
    assert best["mlflow_run_id"] is None
    csv = pd.read_csv(tmp_path / "out" / "trials.csv")
    assert len(csv) == len(trials)
    summary = json.loads((tmp_path / "out" / "study.json").read_text())
    assert summary["trials"] == len(trials) and summary["best_trial"] == best["trial"]
    assert "trials.csv" in result.files
    assert not (tmp_path / "experiments").exists()  # no tracker: no MLflow store anywhere

    # the subscribers heard every step, in order
    kinds = [k for k, _ in rec.calls]
    assert kinds[0] == "study_start" and kinds[-1] == "study_end"
    assert rec.calls[-1][1] is result
    started = [v for k, v in rec.calls if k == "trial_start"]
    ended = [v[0] for k, v in rec.calls if k == "trial_end" and not v[2]]
    assert sorted(started) == sorted(ended) and len(started) == 8 + len(rechecks)
    phases = [v for k, v in rec.calls if k == "phase"]
    assert (0, "starting") in phases and (0, "measuring") in phases
    assert {n for n, p in phases if p == "recheck"} == {t.number for t in rechecks}


def test_an_interrupt_fails_the_running_trial_and_resume_retries_it(
        model: Path, tmp_path: Path) -> None:
    calls = {"n": 0}

    def stop_on_third(params: dict[str, Any], spec: TrialSpec) -> dict[str, float] | str:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return _value(params, spec)

    sim = SimulatedExecutor(stop_on_third)
    rec = Recorder()
    settings = _settings(model, tmp_path, trials=4, recheck=0)
    with pytest.raises(KeyboardInterrupt):
        tune(settings, executor=sim, tracker=False, callbacks=[sim, rec])
    assert rec.calls[-1] == ("study_end", None)
    study = optuna.load_study(study_name="sim", storage=settings.storage)
    stopped = [t for t in study.get_trials() if t.state.name == "FAIL"]
    assert [t.user_attrs[A.REASON] for t in stopped] == ["interrupted"]

    sim2 = SimulatedExecutor(_value)
    result = tune(settings.model_copy(update={"resume": True}), executor=sim2, tracker=False,
                  callbacks=[sim2])
    study = optuna.load_study(study_name="sim", storage=settings.storage)
    assert n_finished(study) == 4 and result.n_trials == len(study.get_trials())
    retry = [t for t in study.get_trials() if A.RETRY_OF in t.user_attrs]
    assert [t.user_attrs[A.RETRY_OF] for t in retry] == [stopped[0].number]
    assert retry[0].params == stopped[0].params


def test_a_lossy_winner_on_random_weights_is_declared_unjudged(model: Path,
                                                               tmp_path: Path) -> None:
    """A winner that sets a lossy knob, on a model without real weights and with the probe
    off: best.json, the summary line and the report say its quality was not judged."""
    from autotune.cli._tune import _verdict_line
    from autotune.quality import caveat_line

    space = tmp_path / "lossy.yaml"
    space.write_text("name: lossy\nknobs:\n  quantization:\n    type: categorical\n"
                     "    choices: [none, fp8]\n    flag: --quantization\n"
                     "    omit_when: none\n    default: none\n    lossy: true\n")

    def value(params: dict[str, Any], spec: TrialSpec) -> dict[str, float] | str:
        tput = 200.0 if params.get("quantization") == "fp8" else 100.0
        return {"output_tokens_per_s": tput, "ttft_p99_s": 0.5, "error_rate": 0.0}

    sim = SimulatedExecutor(value)
    result = tune(_settings(model, tmp_path, space=space, trials=2, recheck=1,
                            recheck_starts=2,
                            enqueue=[{"quantization": "fp8"}]),
                  executor=sim, tracker=False, callbacks=[sim])
    best = json.loads((tmp_path / "out" / "best.json").read_text())
    assert best["verdict"] == "winner" and best["params"] == {"quantization": "fp8"}
    q = best["quality"]
    assert q["judged"] is False and q["lossy_knobs"] == {"quantization": "fp8"}
    assert "random weights" in q["reason"]
    assert result.verdict["quality"] == q
    assert "NOT JUDGED" in caveat_line(result.verdict["quality"])
    assert _verdict_line(result.verdict).startswith("verdict: WINNER")
    assert result.report is not None and "quality NOT judged" in result.report.read_text()


def test_a_pruned_trial_is_counted_apart_from_failures_with_the_pruner_s_reason(
        model: Path, tmp_path: Path) -> None:
    """A trial the pruner stopped is no failure: the counts say 'pruned' on their own, and
    the report's failure lines give the pruner's reason, not its server's shutdown log."""
    import re

    from autotune.cli._tune import summary_lines

    log = tmp_path / "trial-server.log"
    log.write_text("INFO 12:00:01 Started server process [4242]\n"
                   "INFO 12:00:09 Shutting down\nINFO 12:00:09 Waiting for application "
                   "shutdown.\nINFO 12:00:09 Application shutdown complete.\n")

    def value(params: dict[str, Any], spec: TrialSpec) -> dict[str, float] | TrialOutcome:
        if int(params.get("max_num_seqs", 16)) == 64:  # a clear loser, stopped early
            return TrialOutcome(number=0, ok=True, pruned=True, stop="pruned",
                                segments=[50.0, 51.0, 49.0], log_path=str(log),
                                metrics={"output_tokens_per_s": 50.0, "error_rate": 0.0,
                                         "output_tokens_per_s_ci_low": 48.0,
                                         "output_tokens_per_s_ci_high": 52.0})
        return {"output_tokens_per_s": 100.0, "ttft_p99_s": 0.5, "error_rate": 0.0}

    sim = SimulatedExecutor(value)
    result = tune(_settings(model, tmp_path, trials=2, recheck=0,
                            enqueue=[{"max_num_seqs": 64}]),
                  executor=sim, tracker=False, callbacks=[sim])
    assert (result.n_trials, result.n_failed, result.n_pruned) == (2, 0, 1)
    summary = json.loads((tmp_path / "out" / "study.json").read_text())
    assert (summary["failed"], summary["pruned"]) == (0, 1)
    counts = summary_lines(result, "throughput")[0]
    assert "2 trials, 1 feasible, 0 failed, 1 pruned" in counts, counts
    assert "why not feasible" not in counts
    assert result.report is not None
    page = result.report.read_text()
    assert re.search(r"1 failed|failed: pruned", page) is None
    assert "0 failed, 1 pruned" in page
    failures = page.split('id="failures"', 1)[1].split("</section>", 1)[0]
    assert "lay below the incumbent" in failures  # the pruner's reason
    assert "shutdown" not in failures.lower()  # not the server's stopping


def test_a_cpu_study_speaks_of_servers_not_gpus(model: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """On the CPU build of vLLM there is no GPU to count: the summary, `autotune best` and
    the report say 'per server', 'a CPU server' and 'server time'."""
    from autotune.cli import main
    from autotune.cli._tune import summary_lines
    from autotune.engine import detect_engine

    if detect_engine().device != "cpu":
        pytest.skip("the CPU build of vLLM is not the one installed")
    sim = SimulatedExecutor(_value)
    result = tune(_settings(model, tmp_path, trials=3, recheck=1, gpu_hour_price=2.0),
                  executor=sim, tracker=False, callbacks=[sim])
    assert result.best is not None and result.report is not None
    text = "\n".join(summary_lines(result, "throughput"))
    assert "per server" in text, text
    capsys.readouterr()
    assert main(["best", "--shape", str(REPO / "traffic" / "example-chat.json"),
                 "--storage", f"sqlite:///{tmp_path}/optuna.db"]) == 0
    text += capsys.readouterr().out
    assert "a CPU server" in text
    page = result.report.read_text()
    assert "Server-time account" in page and "of server time in all" in page
    for words in ("per GPU", "GPU cpu", "GPU time", "GPU-time", "(GPU)", "GPU(s)",
                  "whole GPUs"):
        assert words not in text, (words, text)
        assert words not in page, words


def _lossy_space(tmp_path: Path) -> Path:
    space = tmp_path / "lossy.yaml"
    space.write_text("name: lossy\nknobs:\n  quantization:\n    type: categorical\n"
                     "    choices: [none, fp8]\n    flag: --quantization\n"
                     "    omit_when: none\n    default: none\n    lossy: true\n")
    return space


def _with_probe(tput: float) -> dict[str, Any]:
    """A measurement of a lossy config whose probe kept 31 of 32 greedy outputs."""
    return {"metrics": {"output_tokens_per_s": tput, "ttft_p99_s": 0.5, "error_rate": 0.0},
            "quality": {"n_prompts": 32, "exact_match_rate": 31 / 32,
                        "first_divergence_mean": 30.5, "first_divergence_p10": 30.0,
                        "mean_abs_logprob_diff": 0.01, "max_abs_logprob_diff": 0.2,
                        "output_tokens": 32.0, "shared_tokens": 900}}


@pytest.mark.parametrize("fp8_tput, subject", [(200.0, "the winner"),
                                               (80.0, "the best other config (trial 1)")])
def test_a_lossy_candidate_s_quality_figure_is_printed_with_the_verdict(
        model: Path, tmp_path: Path, fp8_tput: float, subject: str) -> None:
    """The verdict's candidate sets a lossy knob: the summary gives its probe's figure with
    the verdict, whether it won or vLLM's defaults remain best."""
    from autotune.cli._tune import summary_lines

    def value(params: dict[str, Any], spec: TrialSpec) -> dict[str, float] | TrialOutcome:
        if params.get("quantization") == "fp8":
            return TrialOutcome(number=0, ok=True, **_with_probe(fp8_tput))
        return {"output_tokens_per_s": 100.0, "ttft_p99_s": 0.5, "error_rate": 0.0}

    sim = SimulatedExecutor(value)
    result = tune(_settings(model, tmp_path, space=_lossy_space(tmp_path), trials=2,
                            recheck=1, recheck_starts=2, enqueue=[{"quantization": "fp8"}]),
                  executor=sim, tracker=False, callbacks=[sim])
    lines = summary_lines(result, "throughput")
    verdict = next(i for i, line in enumerate(lines) if line.startswith("verdict:"))
    quality = lines[verdict + 1]
    assert quality.startswith(f"quality: NOT JUDGED: {subject} sets lossy knobs "
                              "(quantization=fp8)"), quality
    assert "31 of 32 greedy outputs unchanged" in quality
    best = json.loads((tmp_path / "out" / "best.json").read_text())
    if subject == "the winner":
        assert best["quality"]["figures"]["n_prompts"] == 32
    else:  # best.json declares the defaults: the word on the other config is not theirs
        assert best["params"] == {} or best["is_baseline"]
        assert best["quality"] is None


def test_a_gpu_budget_is_planned_kept_and_accounted_by_phase(model: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """--budget 20m: the plan is the study's first note, the search stops when the next
    trial and the re-check would not fit, and the summary says where the GPU time went."""
    from autotune.cli._tune import summary_lines

    notes: list[str] = []

    class Notes(StudyCallback):
        def on_note(self, event: StudyEvent) -> None:
            notes.append(event.message)

    sim = SimulatedExecutor(_value, wall_s=100.0)  # each trial: 100 s on its slot
    result = tune(_settings(model, tmp_path, trials=20, budget="20m"), executor=sim,
                  tracker=False, callbacks=[sim, Notes()])
    plan = [n for n in notes if n.startswith("budget: ")]
    assert plan[0].startswith("budget: about 14 trials and 20 server starts fit in 20 "
                              "GPU-minutes at about 60 s a start (a first guess")
    study = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db")
    ran = [t for t in study.get_trials() if t.user_attrs.get(A.REASON) != "rejected"]
    searched = [t for t in ran if A.RECHECK_OF not in t.user_attrs]
    assert 3 <= len(searched) < 20  # the budget, not --trials, ended the search
    phases = study.user_attrs[A.GPU_PHASES]
    assert phases["total"] == 100.0 * len(ran) <= 1200.0
    assert phases["recheck"] == 100.0 * (len(ran) - len(searched))
    assert phases["starts"] + phases["other"] == 100.0 * len(searched)
    assert result.gpu_phases == phases
    line = [x for x in summary_lines(result, "throughput") if x.startswith("GPU-seconds")]
    assert line and "of a 0.333 GPU-hour budget" in line[0]


def test_a_capacity_study_gives_each_trial_the_incumbent_s_capacity_and_counts_pruned_apart(
        model: Path, tmp_path: Path) -> None:
    """The bracket pruner's study side: every search trial but the defaults and re-checks
    is submitted with the incumbent's capacity (its bracket's low end) as its bar; a trial
    pruned against it is PRUNED with its message, counted apart from failed, and its GPU
    time is the account's "pruned"."""
    bars: dict[int, float | None] = {}

    def evaluate(params: dict[str, Any], spec: TrialSpec) -> dict[str, float] | TrialOutcome:
        bars[spec.number] = spec.incumbent_low
        cap = 2.0 + int(params.get("max_num_seqs", 16)) / 16  # req/s
        if spec.incumbent_low is not None and cap * 1.1 < spec.incumbent_low:
            return TrialOutcome(
                number=spec.number, ok=True, pruned=True, stop="capacity_pruned",
                message=f"pruned after 2 level(s): a level failed at {cap * 1.1:.3g} req/s",
                capacity={"recorded_rps": 5.53, "low": None, "high": cap * 1.1 / 5.53,
                          "flat_misses_rps": None, "status": "pruned", "capacity_rps": None,
                          "ci_low_rps": None, "ci_high_rps": cap * 1.1, "levels": []},
                metrics={"capacity_rps_ci_high": cap * 1.1})
        return {"capacity_rps": cap, "capacity_rps_ci_low": cap,
                "capacity_rps_ci_high": cap * 1.1, "error_rate": 0.0}

    sim = SimulatedExecutor(evaluate, wall_s=50.0)
    result = tune(_settings(model, tmp_path, objective="capacity", trials=12, recheck=1),
                  executor=sim, tracker=False, callbacks=[sim])
    study = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = [t for t in study.get_trials() if t.number in bars]
    for t in trials:
        plain = not t.user_attrs.get(A.BASELINE) and A.RECHECK_OF not in t.user_attrs
        assert (bars[t.number] is not None) == (plain and t.number > 0), t.number
    pruned = [t for t in trials if t.user_attrs.get(A.REASON) == "pruned"]
    assert pruned, "no trial was pruned: the bar never reached a trial"
    for t in pruned:
        assert t.state.name == "PRUNED" and t.user_attrs[A.STATE] == "pruned"
        assert t.user_attrs[A.MESSAGE].startswith("pruned after 2 level(s)")
        assert t.user_attrs[A.CAPACITY]["status"] == "pruned"
    assert result.n_pruned == len(pruned)
    assert set(result.failures_by_reason) <= {"pruned", "rejected"}  # none failed
    assert study.user_attrs[A.GPU_PHASES]["pruned"] == 50.0 * len(pruned)


def test_a_study_steers_away_from_configs_the_store_saw_fail_to_start(model: Path,
                                                                       tmp_path: Path) -> None:
    """A second study in the store learns the first one's start failures (max_num_seqs >
    24: oom): samples predicted to fail are told as failed constraints with the predicted
    reason, never started and not counted; the first and last notes say what the model
    learned from and how it did."""
    notes: list[str] = []

    class Notes(StudyCallback):
        def on_note(self, event: StudyEvent) -> None:
            notes.append(event.message)

    def value(params: dict[str, Any], spec: TrialSpec) -> dict[str, float] | str:
        return FailureReason.OOM if int(params.get("max_num_seqs", 16)) > 24 else \
            _value(params, spec)

    first = SimulatedExecutor(value)
    tune(_settings(model, tmp_path, trials=25, recheck=0, study_name="first",
                   out=tmp_path / "first", sampler="random", failure_model=False),
         executor=first, tracker=False, callbacks=[first])
    storage = f"sqlite:///{tmp_path}/optuna.db"
    earlier = optuna.load_study(study_name="first", storage=storage)
    ooms = [t for t in earlier.trials if t.user_attrs.get(A.REASON) == "oom"]
    assert ooms, "the first study never ran out of memory: nothing to learn"

    sim = SimulatedExecutor(value)
    tune(_settings(model, tmp_path, trials=25, recheck=0, sampler="random"), executor=sim,
         tracker=False, callbacks=[sim, Notes()])
    study = optuna.load_study(study_name="sim", storage=storage)
    assert any(n.startswith("failure model: ") and " of 1 study on this engine and hardware, "
               f"{len(ooms)} of them start failures" in n for n in notes), notes
    steered = [t for t in study.trials if t.user_attrs.get(A.REASON) == "predicted_failure"]
    assert steered, "no sample was steered away"
    for t in steered:
        assert t.state.name == "PRUNED" and t.constraints["failed"] == 1.0
        assert t.params["max_num_seqs"] > 16
        assert t.user_attrs[A.MESSAGE].startswith("predicted to fail to start (oom: ")
    assert n_finished(study) == 25  # steered samples are not counted
    model_rec = study.user_attrs[A.FAILURE_MODEL]
    assert model_rec["steered"] == len(steered) and model_rec["studies"] == 1
    assert notes[-1].startswith("failure model (") and "steered" in notes[-1]


def test_no_failure_model_starts_every_sample(model: Path, tmp_path: Path) -> None:
    sim = SimulatedExecutor(_value)
    tune(_settings(model, tmp_path, trials=15, recheck=0, failure_model=False,
                   sampler="random"), executor=sim, tracker=False, callbacks=[sim])
    study = optuna.load_study(study_name="sim", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert not [t for t in study.trials if t.user_attrs.get(A.REASON) == "predicted_failure"]
    assert A.FAILURE_MODEL not in study.user_attrs


def test_a_study_learns_from_an_earlier_study_in_its_store(model: Path, tmp_path: Path) -> None:
    """A new study on the same model and hardware starts from the earlier study's trials
    (weight 1: the same shape), says so first, and samples differently from a cold study of
    the same seed; --no-learn starts cold."""
    notes: list[str] = []

    class Notes(StudyCallback):
        def on_note(self, event: StudyEvent) -> None:
            notes.append(event.message)

    def run(name: str, store: Path, **kw: Any) -> optuna.Study:
        sim = SimulatedExecutor(_value)
        storage = f"sqlite:///{store}"
        tune(_settings(model, tmp_path, trials=8, recheck=0, study_name=name, storage=storage,
                       out=tmp_path / name, **kw), executor=sim, tracker=False,
             callbacks=[sim, Notes()])
        return optuna.load_study(study_name=name, storage=storage)

    run("earlier", tmp_path / "warm.db", seed=7)
    notes.clear()
    warm = run("warm", tmp_path / "warm.db")
    priors = [t for t in warm.trials if A.PRIOR in t.user_attrs]
    assert priors and all(t.user_attrs[A.PRIOR]["weight"] == 1.0 for t in priors)
    assert notes[0] == (f"learned from {len(priors)} earlier trial(s) of 1 study, each reading "
                        "weighted by how near its shape is to this one: earlier "
                        f"({len(priors)} trial(s), shape distance 0.00, weight 1.00)")
    assert n_finished(warm) == 8  # the priors do not count
    cold = run("cold", tmp_path / "cold.db")
    assert notes[-1].startswith("failure model") and any(
        n.startswith("learned from no earlier study") for n in notes)

    def sampled(study: optuna.Study) -> list[dict[str, Any]]:
        return [t.params for t in study.trials
                if A.PRIOR not in t.user_attrs and not t.user_attrs.get(A.BASELINE)]

    assert sampled(warm) != sampled(cold)
    off = run("off", tmp_path / "warm.db", learn=False)
    assert not [t for t in off.trials if A.PRIOR in t.user_attrs]
