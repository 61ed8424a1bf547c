"""The study report: what it computes (unit tests on SQLite studies made here) and how it
renders in a real browser (Chromium via Playwright: no console error, every section, a hover).

Reports of real studies are opened in the browser by the e2e study (tests/e2e/test_study_e2e.py),
the fault suite's studies (every kind of failure; all infeasible, then resumed) and a real
CPU vLLM study whose every server refuses its flags (below, slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from autotune.engine import classifying_lines
from autotune.report import SECTIONS, explain_no_winner, load_report_data, render_html, write_report
from autotune.report._data import TrialRow
from tests._browser import open_report
from tests.conftest import REPO, needs_vllm

DISTS = {"max_num_seqs": IntDistribution(1, 256),
         "prefix": CategoricalDistribution([True, False])}
VLLM_REJECT = ("usage: api_server.py [-h] ...\napi_server.py: error: unrecognized arguments: "
               "--no-such-flag\n")


def _metrics(tps: float, ci: bool = True) -> dict[str, float]:
    m = {"output_tokens_per_s": tps, "error_rate": 0.0, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2,
         "ttft_p99_s": 0.3, "tpot_p50_s": 0.01, "tpot_p90_s": 0.02, "tpot_p99_s": 0.03,
         "e2e_p50_s": 1.0, "e2e_p90_s": 1.5, "e2e_p99_s": 2.0}
    if ci:
        m.update(output_tokens_per_s_ci_low=tps * 0.95, output_tokens_per_s_ci_high=tps * 1.04)
    return m


def _make_study(tmp_path: Path, *, recorded: bool, pareto: bool = False) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{tmp_path}/o.db"
    study = optuna.create_study(storage=storage, study_name="s",
                                directions=["maximize", "minimize"] if pareto else ["maximize"])
    shape = tmp_path / "shape.json"
    shape.write_text((REPO / "traffic" / "example-chat.json").read_text())
    fp = json.loads(shape.read_text())["fingerprint"]
    study.set_user_attr("autotune.shape_path", str(shape))
    study.set_user_attr("autotune.shape_fingerprint", fp)
    study.set_user_attr("autotune.settings", {"objective": "pareto" if pareto else "throughput",
                                              "pareto_latency": "ttft_p99", "trials": 5})
    if recorded:
        study.set_user_attr("autotune.verdict", {
            "verdict": "winner", "winner_number": 2, "baseline_number": 0,
            "ratio_to_defaults": {"median": 1.31, "ci_low": 1.12, "ci_high": 1.5}})
        study.set_user_attr("autotune.gpu_time", {"gpu 0": {
            "start_s": 300.0, "warmup_s": 60.0, "measure_s": 400.0, "idle_s": 5.0,
            "other_s": 20.0}})
    log = tmp_path / "trial-0003-server.log"
    log.write_text("INFO starting\n" * 50 + VLLM_REJECT + "INFO bye\n")

    def add(number: int, tps: float | None, *, state: str = "ok", reason: str = "",
            baseline: bool = False, recheck: int | None = None, message: str = "") -> None:
        ua: dict[str, Any] = {"autotune.state": state, "autotune.wall_s": 100.0,
                              "autotune.start_s": 60.0}
        if baseline:
            ua["autotune.baseline"] = True
        if recheck is not None:
            ua["autotune.recheck_of"] = recheck
        if reason:
            ua["autotune.reason"], ua["autotune.message"] = reason, message
        if tps is not None:
            ua["autotune.metrics"] = _metrics(tps)
        else:
            ua["autotune.log_path"] = str(log)
        same = number if recheck is None else recheck  # a re-check runs the same config
        values = None if tps is None else ([tps, 0.3 + tps / 1e4] if pareto else [tps])
        infeasible = state != "ok"
        study.add_trial(optuna.trial.create_trial(
            params={"max_num_seqs": 8 * (same + 1), "prefix": same % 2 == 0},
            distributions=DISTS, values=values,
            state=TrialState.COMPLETE if tps is not None else TrialState.PRUNED,
            user_attrs=ua, constraints={"failed": 1.0 if tps is None else 0.0, "slo": 0.0,
                                        "errors": 1.0 if infeasible else 0.0,
                                        "quality": 0.0}))

    add(0, 1000.0, baseline=True)
    add(1, 1100.0)
    add(2, 1300.0)
    add(3, None, state="failed", reason="invalid_config", message="vLLM rejected the flags")
    add(4, 900.0, state="infeasible", reason="errors",
        message="error rate 80.0% > 5.0% (failed requests: stalled 97%, timeout 3%)")
    add(5, 1280.0, recheck=2)
    add(6, 1010.0, baseline=True, recheck=0)
    return storage


def test_report_data_reads_recorded_figures_and_computes_the_rest(tmp_path: Path) -> None:
    storage = _make_study(tmp_path / "a", recorded=True)
    d = load_report_data(storage=storage)  # the newest study by default
    assert d.study_name == "s" and d.verdict_source == "recorded"
    assert d.verdict["ratio_to_defaults"]["ci_low"] == 1.12
    assert d.gpu_time_source == "recorded" and d.gpu_time["gpu 0"]["measure_s"] == 400.0
    assert [t.state for t in d.trials] == ["ok", "ok", "ok", "failed", "infeasible", "ok", "ok"]
    assert d.trials[1].interval == pytest.approx((1045.0, 1144.0))

    storage = _make_study(tmp_path / "b", recorded=False)
    d = load_report_data(storage=storage, study_name="s")
    assert d.verdict_source == "computed"
    v = d.verdict
    # the winner as the study's own verdict picks it (schema.verdict): once re-checked, only
    # the fresh-server readings count (1280 against the defaults' 1010; the search readings
    # 1300 and 1000 were picked for being high); one reading a side gives no interval
    assert v["winner_number"] in (2, 5) and v["verdict"] == "winner"
    assert v["ratio_to_defaults"]["median"] == pytest.approx(1280 / 1010)
    assert v["ratio_to_defaults"]["ci_low"] is None
    assert d.gpu_time_source == "computed"
    acc = d.gpu_time["local"]
    assert acc["start_s"] == 7 * 60.0 and acc["measure_s"] == 6 * 40.0 and acc["other_s"] == 40.0
    page = render_html(d)
    assert "computed by this report from the stored readings" in page
    assert "computed from each trial&#x27;s start and wall times" in page
    assert "<script src=" not in page and "plotly.js v" in page  # plotly.js inlined


def test_missing_study_and_storage_errors(tmp_path: Path) -> None:
    from autotune.errors import StudyError

    storage = _make_study(tmp_path, recorded=False)
    with pytest.raises(StudyError, match="study 'nope' is not in .*known studies: s"):
        load_report_data(storage=storage, study_name="nope")
    with pytest.raises(StudyError, match="no study in"):
        load_report_data(storage=f"sqlite:///{tmp_path}/empty.db")


def test_classifying_lines_pick_the_lines_that_named_the_failure() -> None:
    log = "x\n" * 30 + VLLM_REJECT + "y\n"
    lines = classifying_lines(log, "invalid_config")
    assert any("unrecognized arguments: --no-such-flag" in ln for ln in lines)
    assert len(lines) <= 4  # the hit and its neighbours, not the whole log
    assert classifying_lines("a\nb\nc\n", "crash", max_lines=2) == ["b", "c"]  # no pattern: tail


def test_failure_summary_keeps_the_line_that_named_the_failure() -> None:
    from autotune.report import failure_summary

    msg = ("vLLM exited with code 2 during start (invalid_config); last log lines:\n"
           + "[--some-flag X]\n" * 40 + "api_server.py: error: unrecognized arguments: --x\n"
           "--- server log tail ---\n...")
    assert failure_summary(msg.split("\n---", 1)[0], "invalid_config") == (
        "vLLM exited with code 2 during start (invalid_config); last log lines: "
        "api_server.py: error: unrecognized arguments: --x")
    assert failure_summary("vLLM crashed\na\nlast words", "crash") == "vLLM crashed: last words"
    assert failure_summary("error rate 50% > 5%", "errors") == "error rate 50% > 5%"
    assert failure_summary("", "oom") == ""


def _row(state: str, reason: str, message: str = "", **metrics: float) -> TrialRow:
    return TrialRow(number=0, state=state, reason=reason, message=message, value=None,
                    values=(), baseline=False, recheck_of=None, params={}, metrics=metrics,
                    start_s=None, wall_s=None, log_path=None, slot="local",
                    request_errors={"stalled": 70, "timeout": 2} if reason == "errors" else {})


def test_explain_no_winner_says_why_and_what_to_try() -> None:
    text = explain_no_winner([_row("infeasible", "errors", error_rate=0.73),
                              _row("infeasible", "errors", error_rate=0.82),
                              _row("infeasible", "errors", error_rate=0.8)],
                             {"max_error_rate": 0.05, "concurrency": 64})
    assert text.startswith("all 3 trials infeasible (errors (3)): 73-82 % of requests failed")
    assert "mostly stalled (97% of the failures" in text and "--concurrency 64" in text
    assert "try a lower --concurrency" in text and "\n" not in text
    text = explain_no_winner([_row("infeasible", "slo", ttft_p99_s=3.1),
                              _row("infeasible", "slo", ttft_p99_s=4.0)],
                             {"slo": {"ttft_p99": 2.0}})
    assert "ttft_p99 3.1-4 s against --slo ttft_p99=2" in text and "Loosen --slo" in text
    text = explain_no_winner([_row("failed", "invalid_config", "vLLM rejected: --x\nlog"),
                              _row("rejected", "rejected")])
    assert text.startswith("all 1 trial failed or infeasible (invalid_config (1))")
    assert '"vLLM rejected: --x: log"' in text and "check the space" in text
    assert "--resume" in explain_no_winner([_row("interrupted", "interrupted")])


def test_report_in_the_browser(tmp_path: Path) -> None:
    storage = _make_study(tmp_path, recorded=True, pareto=True)
    path = write_report(tmp_path / "report.html", storage=storage, study_name="s")
    with open_report(path) as page:
        assert page.sections() == [*SECTIONS, "config"]
        label = page.hover_a_point("plot-history")
        assert "trial #1" in label or "defaults" in label
        assert page.page.locator("#plot-history .errorbar").count() > 0  # the intervals
        assert "1.310x" in page.text("#verdict") and "[1.120, 1.500]" in page.text("#verdict")
        assert "unrecognized arguments: --no-such-flag" in page.text("#failures")
        assert "stalled 97%" in page.text("#failures")
        assert "Pareto front" in page.text("#plot-pareto")
        for plot in ("shape", "importance", "latency", "failures", "gpu-time"):
            assert page.page.locator(f"#plot-{plot} .main-svg").count() > 0, plot
        assert page.errors == [] and page.requests == []


@needs_vllm
@pytest.mark.slow
def test_report_of_a_real_study_whose_every_server_fails(tiny_llama: Path, tmp_path: Path
                                                         ) -> None:
    """Real CPU vLLM refusing a flag's value in every trial: the console, trials.csv and the
    report say why (the lines of vLLM's log that classified each failure). A value, not an
    unknown flag: unknown flags stop the study before trial 0 (tests/integration/test_preflight.py)."""
    space = tmp_path / "bad.yaml"
    space.write_text("name: bad\nfixed_flags: ['--max-model-len', '1024', "
                     "'--kv-cache-dtype', 'no-such-dtype']\n"
                     "knobs:\n  max_num_seqs:\n    type: int\n    low: 4\n    high: 16\n"
                     "    flag: --max-num-seqs\n")
    storage = f"sqlite:///{tmp_path}/o.db"
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "tune", "--model", str(tiny_llama),
         "--shape", str(REPO / "traffic" / "example-chat.json"), "--space", str(space),
         "--trials", "1", "--no-baseline", "--storage", storage, "--tracking-uri", f"sqlite:///{tmp_path}/m.db",
         "--study-name", "bad", "--out", str(out), "--no-ray", "--recheck", "0",
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "all 1 trial failed or infeasible (invalid_config (1))" in proc.stdout
    # the line of vLLM's log that named the failure, on the console as the trial ends and
    # in the closing paragraph
    bad = "argument --kv-cache-dtype: invalid choice: 'no-such-dtype'"
    assert bad in proc.stdout and "vLLM rejected" in proc.stdout, proc.stdout[-3000:]
    assert "failed: invalid_config: vLLM exited" in proc.stderr
    assert bad in proc.stderr
    import pandas as pd

    df = pd.read_csv(out / "trials.csv")
    assert list(df["reason"]) == ["invalid_config"]
    assert bad in df["message"][0]
    assert list(df["constraint.failed"]) == [1.0]
    with open_report(out / "report.html") as page:
        assert page.sections() == [*SECTIONS, "config"]
        assert "No verdict" in page.text("#verdict")
        assert bad in page.text("#failures pre")
        assert "invalid_config" in page.hover_a_point("plot-history")
        assert page.errors == [] and page.requests == []


def test_a_capacity_study_shows_each_leaders_load_levels(tmp_path: Path) -> None:
    # --objective capacity: the report shows the levels behind each leader's bracket, with
    # which SLO the misses exceeded, the level length used and the flat-misses note
    storage = f"sqlite:///{tmp_path}/c.db"
    study = optuna.create_study(storage=storage, study_name="cap")
    study.set_user_attr("autotune.settings", {"objective": "capacity", "trials": 2})

    def lv(rps: float, passed: bool, finished: int | None, over: dict[str, int]
           ) -> dict[str, Any]:
        d = {"scale": rps / 3.4, "offered_rps": rps, "passed": passed,
             "goodput_fraction": 0.99 if passed else 0.4, "error_rate": 0.0, "offered": 400,
             "ttft_p99_s": 0.4, "tpot_p99_s": 0.09 if passed else 0.12, "seconds": 40.0,
             "stopped_early": not passed, "note": "", "jit_compiled": False, "reruns": 0}
        if finished is not None:  # levels recorded before autotune kept these lack them
            d.update(finished=finished, missed_by=over)
        return d

    for number, levels, extra in (
            (0, [lv(13.6, True, 400, {"tpot": 3}), lv(27.2, False, 300, {"tpot": 5}),
                 lv(19.2, True, 400, {"tpot": 4})],
             {"level_s": 36.0, "level_s_asked": 20.0, "flat_misses_rps": [13.6, 27.2]}),
            (1, [lv(13.6, True, None, {}), lv(27.2, False, None, {})], {})):
        cap = {"recorded_rps": 3.4, "low": 19.2 / 3.4 if number == 0 else 4.0,
               "high": 8.0, "status": "levels", "levels": levels, **extra}
        value = 19.2 if number == 0 else 13.6
        study.add_trial(optuna.trial.create_trial(
            params={"max_num_seqs": 8 * (number + 1), "prefix": True}, distributions=DISTS,
            values=[value],
            user_attrs={"autotune.state": "ok", "autotune.baseline": number == 0,
                        "autotune.capacity": cap,
                        "autotune.metrics": {"capacity_rps": value,
                                             "capacity_rps_ci_low": value,
                                             "capacity_rps_ci_high": 27.2}},
            constraints={"failed": 0.0, "slo": 0.0, "errors": 0.0, "quality": 0.0}))
    html = render_html(load_report_data(storage=storage, study_name="cap"))
    sec = html.split('<section id="capacity">', 1)[1].split("</section>", 1)[0]
    assert "vLLM defaults #0: bracket [19.2, 27.2] req/s" in sec
    assert "levels of 36 s of arrivals (asked 20)" in sec
    assert "tpot 5" in sec and "300 / 400" in sec and "<b>fail</b>" in sec
    assert "from 13.6 to 27.2 req/s every level missed the SLOs" in sec
    assert "trial #1: bracket [13.6, 27.2] req/s" in sec and "not recorded" in sec
    # a throughput study says it has no levels
    other = _make_study(tmp_path / "t", recorded=True)
    html = render_html(load_report_data(storage=other, study_name="s"))
    assert "not a capacity study" in html.split('<section id="capacity">', 1)[1]
