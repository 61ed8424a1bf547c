"""A capacity verdict reads its brackets (docs/measurement.md, sections 9 and 11): one start
each gives every ratio the two brackets allow, repeated starts are never narrower than the
brackets resolve, an open bracket gives a bound and no winner; and a capacity, its bracket
and the GPUs it needs print the same way in the summary, ``autotune best``, the progress and
the report. Pure: studies in Optuna's memory, no server."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from scipy import stats

from autotune.measure import (
    CAPACITY_BRACKETS,
    Interval,
    bracket_bound,
    ratio_to_defaults,
    starts_needed,
)
from autotune.store import judge_study, verdict_record
from tests._capacity_study import capacity_study
from tests._records import best_file
from tests.conftest import REPO


def _iv(low: float, high: float) -> Interval:
    return Interval(low, low, high)


# --- the ratio and its interval ------------------------------------------------------------


def test_one_start_each_gives_every_ratio_the_two_brackets_allow() -> None:
    # the H200's azure recipe [18.60, 20.28] against the defaults' [12.06, 13.15]
    r = ratio_to_defaults([18.60], [12.06], brackets={"config": [_iv(18.60, 20.28)],
                                                      "defaults": [_iv(12.06, 13.15)]})
    assert r is not None and r.method == CAPACITY_BRACKETS
    assert r.median == pytest.approx(18.60 / 12.06)
    assert (r.ci_low, r.ci_high) == pytest.approx((18.60 / 13.15, 20.28 / 12.06))
    assert r.log_sd is None and starts_needed(r) is None  # no start-to-start spread measured
    # brackets that overlap allow a ratio below 1: not shown
    r = ratio_to_defaults([14.3], [13.0], brackets={"config": [_iv(14.3, 15.6)],
                                                    "defaults": [_iv(13.0, 14.5)]})
    assert r is not None and r.ci_low == pytest.approx(14.3 / 14.5)
    assert r.ci_low < 1.0 < r.median


def test_repeated_starts_are_never_narrower_than_the_brackets_resolve() -> None:
    # three starts each that read the very same levels: no start-to-start spread at all,
    # yet each capacity lies anywhere in a bracket 10 % wide (the search's tolerance)
    c, d = [2.2, 2.2, 2.2], [2.0, 2.0, 2.0]
    plain = ratio_to_defaults(c, d)
    assert plain is not None and plain.ci_low == pytest.approx(plain.ci_high)  # a point
    br = {"config": [_iv(2.2, 2.42)] * 3, "defaults": [_iv(2.0, 2.2)] * 3}
    r = ratio_to_defaults(c, d, brackets=br)
    assert r is not None and r.median == pytest.approx(1.1) and r.df == 4
    w = math.log(1.1) ** 2 / 12  # each config's mean squared log width / 12, per start
    half = float(stats.t.ppf(0.975, 4)) * math.sqrt(w / 3 + w / 3)
    assert (r.ci_low, r.ci_high) == pytest.approx((1.1 * math.exp(-half), 1.1 * math.exp(half)))
    assert r.log_bracket_var == pytest.approx(2 * w) and "brackets" in r.method
    # the bracket term adds to the start-to-start one in quadrature
    c2, d2 = [2.2, 2.42], [2.0, 2.1]
    r2 = ratio_to_defaults(c2, d2, brackets={"config": [_iv(2.2, 2.42)] * 2,
                                             "defaults": [_iv(2.0, 2.2)] * 2})
    base = ratio_to_defaults(c2, d2)
    assert r2 is not None and base is not None and base.log_sd is not None
    se = math.sqrt(base.log_sd ** 2 * (1 / 2 + 1 / 2) + w / 2 + w / 2)
    q = float(stats.t.ppf(0.975, 2))
    assert r2.ci_low == pytest.approx(r2.median * math.exp(-q * se))
    assert r2.ci_low < base.ci_low and r2.ci_high > base.ci_high
    # planning counts the bracket's share too: with no spread, starts still cost width
    assert starts_needed(r) is not None and starts_needed(r) > 2  # type: ignore[operator]


def test_an_open_bracket_gives_a_bound_and_never_a_ratio() -> None:
    closed_c, closed_d = _iv(3.0, 3.3), _iv(2.0, 2.2)
    open_c, open_d = _iv(3.0, math.inf), _iv(2.0, math.inf)
    for c, d in ((open_c, closed_d), (closed_c, open_d), (open_c, open_d)):
        assert ratio_to_defaults([c.value], [d.value],
                                 brackets={"config": [c], "defaults": [d]}) is None
    least = bracket_bound([open_c], [closed_d])
    assert least is not None and least.kind == "at_least"
    assert least.value == pytest.approx(3.0 / 2.2)  # low_c / high_d
    most = bracket_bound([closed_c], [open_d])
    assert most is not None and most.kind == "at_most"
    assert most.value == pytest.approx(3.3 / 2.0)  # high_c / low_d
    assert bracket_bound([open_c], [open_d]) is None  # nothing bounds it
    assert bracket_bound([closed_c], [closed_d]) is None  # a ratio, not a bound
    # over several starts: their mean logs
    two = bracket_bound([open_c, _iv(4.0, 4.4)], [closed_d, _iv(2.5, 2.6)])
    assert two is not None and two.value == pytest.approx(math.sqrt(3.0 * 4.0 / (2.2 * 2.6)))


# --- the study's verdict -------------------------------------------------------------------


def test_a_study_of_one_start_each_judges_by_the_brackets() -> None:
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 18.60, 20.28, None, "found"),
                            (9, 10.0, 11.0, None, "found")])
    j = judge_study(study)
    # the brackets lie above 1, but one start each: a lead, never a winner (issue 66)
    assert j is not None and j.verdict == "unconfirmed" and j.ratio is not None
    assert [t.number for t in j.declared] == [0]  # best.json keeps the defaults
    assert j.ratio.method == CAPACITY_BRACKETS
    assert (j.ratio.ci_low, j.ratio.ci_high) == pytest.approx((18.60 / 13.15, 20.28 / 12.06))
    rec = verdict_record(j)
    assert rec["method"] == CAPACITY_BRACKETS and rec["ratio_bound"] is None
    # per GPU: a two-GPU server's bracket is halved with its reading
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 2 * 18.60, 2 * 20.28, None, "found", 2)])
    j = judge_study(study)
    assert j is not None and j.ratio is not None
    assert (j.ratio.ci_low, j.ratio.ci_high) == pytest.approx((18.60 / 13.15, 20.28 / 12.06))


def test_a_cut_search_says_which_trial_where_the_bound_and_the_fix() -> None:
    # the candidate passed every level until its time cap: at least 18.60 / 13.15
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 18.60, None, None, "time")])
    j = judge_study(study)
    assert j is not None and j.verdict == "defaults_best" and j.ratio is None
    assert j.bound is not None and j.bound.kind == "at_least"
    rec = verdict_record(j)
    assert rec["ratio_to_defaults"] is None
    assert rec["ratio_bound"] == {"kind": "at_least", "value": pytest.approx(18.60 / 13.15)}
    assert "trial 1 at its time cap (--capacity-max-s)" in j.reason
    assert "at least 1.414x" in j.reason and "no winner comes from it" in j.reason
    assert "leave --capacity-max-s out" in j.reason
    # the defaults passed at the top scale: at most high_c / low_d
    study = capacity_study([(None, 12.06, None, None, "capped"),
                            (17, 18.60, 20.28, None, "found")])
    j = judge_study(study)
    assert j is not None and j.bound is not None and j.bound.kind == "at_most"
    assert j.bound.value == pytest.approx(20.28 / 12.06)
    assert "trial 0 at its top scale" in j.reason and "--capacity-start" in j.reason
    # the level budget spent before a level failed
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 18.60, None, None, "levels")])
    j = judge_study(study)
    assert j is not None and "--capacity-max-levels" in j.reason


def test_a_closed_bracket_that_a_cap_cut_short_gives_no_ratio() -> None:
    # the candidate's bracket closed, [18.60, 29.76] (1.6x wide), but its time cap ended the
    # search before it was within the tolerance: no ratio, the range the brackets allow
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 18.60, 29.76, None, "time")])
    j = judge_study(study)
    assert j is not None and j.verdict == "defaults_best" and j.ratio is None
    assert "trial 1 at its time cap" in j.reason and "cut short" in j.reason
    assert f"from {18.60 / 13.15:.3f}x to {29.76 / 12.06:.3f}x" in j.reason
    # the same brackets from a search that reached its tolerance give a ratio
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 18.60, 29.76, None, "found")])
    j = judge_study(study)
    assert j is not None and j.ratio is not None and j.ratio.ci_low == pytest.approx(
        18.60 / 13.15)


def test_fresh_starts_keep_the_delta_method_widened_by_the_brackets() -> None:
    # every config re-checked: the search readings count as one more start each
    study = capacity_study([(None, 12.0, 13.2, None, "found"), (17, 18.0, 19.8, None, "found"),
                            (None, 12.5, 13.75, 0, "found"), (17, 18.5, 20.35, 1, "found"),
                            (None, 11.8, 12.98, 0, "found"), (17, 18.2, 20.02, 1, "found")])
    j = judge_study(study)
    assert j is not None and j.ratio is not None and "brackets" in j.ratio.method
    plain = ratio_to_defaults([18.0, 18.5, 18.2], [12.0, 12.5, 11.8])
    assert plain is not None and j.ratio.median == pytest.approx(plain.median)
    assert j.ratio.ci_low < plain.ci_low and j.ratio.ci_high > plain.ci_high


# --- how it prints ------------------------------------------------------------------------


def test_the_verdict_line_gives_the_bound_and_why_never_a_point() -> None:
    from autotune.cli._tune import _verdict_line

    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 18.60, None, None, "time")])
    line = _verdict_line(dict(verdict_record(judge_study(study))))
    assert "at least 1.414x the defaults (a bound, not a ratio)" in line
    assert "trial 1 at its time cap (--capacity-max-s)" in line and "None" not in line
    both = capacity_study([(None, 12.06, None, None, "time"), (17, 18.60, None, None, "time")])
    line = _verdict_line(dict(verdict_record(judge_study(both))))
    assert "nothing bounds the ratio" in line and "trials 0, 1" in line
    one = capacity_study([(None, 12.06, 13.15, None, "found"), (17, 18.60, 20.28, None, "found")])
    record = dict(verdict_record(judge_study(one)))
    record["confirm_command"] = "autotune tune --config out/config.yaml --resume --recheck 1"
    line = _verdict_line(record)
    # the range two brackets allow, labelled as such (issue 66): not a 95 % interval
    assert ("1.542x the defaults (the range the brackets allow [1.414, 1.682], not a 95 % "
            "interval)") in line
    assert "trial 1 leads, unconfirmed: one server start each" in line
    assert "WINNER" not in line and "95 % interval [" not in line
    assert line.endswith(": autotune tune --config out/config.yaml --resume --recheck 1")


def _block(**kw: Any) -> dict[str, Any]:
    return {"capacity_rps": 14.34, "capacity_rps_ci_low": 14.34, "capacity_rps_ci_high": 15.64,
            "goodput_bar": 0.99, "slo": {"ttft_p99": 2.0}, "recorded_rps": 5.53,
            "gpus_needed": 5.53 / 14.34, "output_tokens_per_s_at_capacity": 1655.1,
            "search": "found", **kw}


def test_gpus_needed_are_at_most_the_passing_levels_and_say_so() -> None:
    from autotune.cli._tune import capacity_line

    line = capacity_line(_block())
    assert line == ("capacity: 14.3 req/s mean rate within the SLOs (bracket [14.3, 15.6] req/s, >= 99% "
                    "of requests within ttft_p99=2s); 1,655 out tok/s while the level ran; GPUs needed "
                    "for the recorded 5.53 req/s: at most 0.386 (the bracket puts it in "
                    "[0.354, 0.386])")
    cut = capacity_line(_block(capacity_rps_ci_high=None, search="time",
                               output_tokens_per_s_at_capacity=None))
    assert cut.startswith("capacity: at least 14.3 req/s mean rate within the SLOs (bracket [14.3, none "
                          "failed] req/s: no load level failed before the search ended at its "
                          "time cap (--capacity-max-s): a lower bound; leave --capacity-max-s "
                          "out")
    assert "output tokens/s at that rate not recorded" in cut
    assert cut.endswith("at most 0.386 (no load level failed: fewer may do)")
    assert "?" not in line + cut
    # the summary's best line: at least the capacity, at most the servers and GPUs
    from autotune.cli._tune import _best_line

    b = {"trial": 2, "objective": {"value": 10.0}, "capacity": {"bracket_closed": False},
         "gpus": {"per_server": 2, "servers_needed": 0.553, "gpus_needed": 1.106,
                  "servers_needed_low": None, "gpus_needed_low": None, "needed_is": "at_most"}}
    assert _best_line(best_file("capacity", **b), "capacity") == (
        "best: trial 2: at least 10.0 req/s capacity per GPU (a server of 2 GPUs; the recorded "
        "traffic needs at most 0.553 server(s) (no load level failed: fewer may do), at most "
        "1.11 GPU(s) (no load level failed: fewer may do))")
    b["capacity"]["bracket_closed"] = True
    b["gpus"].update(servers_needed_low=0.5, gpus_needed_low=1.0)
    assert "needs at most 0.553 server(s) (the bracket puts it in [0.500, 0.553]), at most " \
        "1.11 GPU(s) (the bracket puts it in [1.00, 1.11])" in _best_line(
            best_file("capacity", **b), "capacity")


def test_best_json_keeps_its_keys_and_adds_the_range(tmp_path: Path) -> None:
    from autotune.config import TuneSettings
    from autotune.results._outputs import capacity_record, gpus_record
    from autotune.traffic import load_shape

    settings = TuneSettings(model=Path("m"), shape=Path("s"), space=Path("x"),
                            objective="capacity")
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 2 * 18.60, 2 * 20.28, None, "found", 2),
                            (9, 10.0, None, None, "time")], recorded_rps=5.53042)
    base, two, cut = study.trials
    c = capacity_record(two, 2 * 18.60, settings).model_dump()
    assert c["servers_needed"] == pytest.approx(5.53042 / 37.2)  # the sizing figure
    assert c["gpus_needed"] == pytest.approx(2 * 5.53042 / 37.2)
    assert c["servers_needed_low"] == pytest.approx(5.53042 / 40.56)
    assert c["gpus_needed_low"] == pytest.approx(2 * 5.53042 / 40.56)
    assert c["needed_is"] == "at_most" and c["bracket_closed"] is True
    open_c = capacity_record(cut, 10.0, settings).model_dump()
    assert open_c["bracket_closed"] is False and open_c["gpus_needed_low"] is None
    assert open_c["gpus_needed"] == pytest.approx(5.53042 / 10.0)
    shape = load_shape(REPO / "traffic" / "azure-conv.json")
    g = gpus_record(two, 18.60, settings, shape).model_dump()  # the value per GPU
    assert g["per_server"] == 2 and g["needed_is"] == "at_most"
    assert g["gpus_needed"] == pytest.approx(2 * 5.53042 / 37.2)
    assert g["gpus_needed_low"] == pytest.approx(2 * 5.53042 / 40.56)
    assert g["basis"] == "the recorded 5.53 req/s / a server's capacity"
    thr = gpus_record(base, 1000.0, settings.model_copy(update={"objective": "throughput"}),
                      shape).model_dump()
    assert thr["needed_is"] == "estimate" and thr["gpus_needed_low"] is None


def test_one_capacity_prints_the_same_in_every_place() -> None:
    """0.32149 req/s in a bracket to 2.5671: the summary, ``autotune best``, the progress
    panel and the report all read "0.321" and "[0.321, 2.57] req/s"."""
    from dataclasses import replace

    from autotune.cli._best import _capacity_of
    from autotune.cli._progress import ProgressState
    from autotune.cli._tune import _best_line, capacity_line
    from autotune.report import ReportData, render_html, trial_row

    v, hi = 0.32149, 2.5671
    summary = capacity_line(_block(capacity_rps=v, capacity_rps_ci_low=v,
                                   capacity_rps_ci_high=hi, gpus_needed=5.53 / v))
    hit = SimpleNamespace(value=v, metrics={
        "capacity_rps": v, "capacity_rps_ci_low": v, "capacity_rps_ci_high": hi,
        "capacity_recorded_rps": 5.53, "servers_needed": 5.53 / v, "gpus_needed": 5.53 / v})
    best = capacity_line(_capacity_of(hit))
    st = ProgressState()
    st.apply(SimpleNamespace(study_name="s", done=1, total=2, best_value=v, best_number=0,
                             best_ci_low=v, best_ci_high=hi, baseline_value=None, eta_s=None,
                             elapsed_s=1.0, kind="trial_finished", running=0,
                             trial_number=0))
    progress = st.best_text("req/s capacity")
    line = _best_line(best_file("capacity", trial=0, objective={"value": v}), "capacity")
    study = capacity_study([(None, v, hi, None, "found")], recorded_rps=5.53)
    row = trial_row(study.trials[0])
    row = replace(row, capacity={**row.capacity, "levels": [{
        "scale": v / 5.53, "offered_rps": v, "passed": True, "goodput_fraction": 1.0,
        "offered": 20, "finished": 20, "missed_by": {}}]})
    data = ReportData(study_name="s", storage="sqlite://", attrs={}, n_objectives=1,
                      metric="capacity_rps", trials=[row], out_dir=None, shape=None,
                      shape_note="", verdict=None, verdict_source="none", gpu_time=None,
                      gpu_time_source="none", importances=None, importance_note="")
    report = render_html(data).split('<section id="capacity">', 1)[1].split("</section>")[0]
    for text in (summary, best, progress, report):
        assert "[0.321, 2.57]" in text, text
    assert "0.321 req/s mean rate within the SLOs" in summary and "0.321 req/s mean rate within the SLOs" in best
    assert progress.startswith("best 0.321 [0.321, 2.57] req/s capacity")
    assert "0.321 req/s capacity" in line
    assert "[0.321, 2.57] req/s" in report and "<td>0.321</td>" in report


def test_a_lower_bound_reads_at_least_in_the_progress() -> None:
    from autotune.cli._progress import ProgressDisplay

    class Sink:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def print(self, text: str, **kw: Any) -> None:
            self.lines.append(text)

        is_terminal = False

    sink = Sink()
    d = ProgressDisplay("req/s capacity", console=sink, live=False)
    d(SimpleNamespace(kind="trial_finished", study_name="s", done=1, total=2, running=0,
                      best_value=14.34, best_number=1, best_ci_low=14.34, best_ci_high=None,
                      baseline_value=12.06, eta_s=None, elapsed_s=1.0, trial_number=1,
                      trial_value=14.34, trial_ci_low=14.34, trial_ci_high=None,
                      trial_reason=None, message="", trial_params={}))
    assert "best at least 14.3 req/s capacity (trial 1: no load level failed)" in sink.lines[-1]
    assert "at least 14.3 req/s capacity[/] (no load level failed" in sink.lines[-1]
    assert "x defaults" not in sink.lines[-1]  # no ratio from a lower bound
    assert "time left not known yet" in sink.lines[-1]


def test_the_report_says_a_bound_and_how_a_shape_replays() -> None:
    from autotune.report import ReportData, render_html
    from autotune.report._html import replay_text
    from autotune.traffic import load_shape

    shape = load_shape(REPO / "traffic" / "azure-conv.json").model_dump(mode="json")
    assert shape["load"]["rate_rps"] is None  # replayed at the recorded rate
    assert replay_text(shape) == "replayed as open loop at the recorded 5.53 req/s, 1,000 requests"
    fast = {**shape, "load": {**shape["load"], "time_scale": 0.5}}
    assert replay_text(fast).startswith("replayed as open loop at 11.1 req/s (the recorded 5.53")
    assert replay_text({"load": {"mode": "open"}}).startswith(
        "replayed as open loop at its recorded arrival times")
    closed = load_shape(REPO / "traffic" / "casestudy-512x512.json").model_dump(mode="json")
    assert replay_text(closed).startswith("replayed as closed loop, ")
    study = capacity_study([(None, 12.06, 13.15, None, "found"),
                            (17, 18.60, None, None, "time")])
    rec = dict(verdict_record(judge_study(study)))
    data = ReportData(study_name="s", storage="sqlite://", attrs={}, n_objectives=1,
                      metric="capacity_rps", trials=[], out_dir=None, shape=shape,
                      shape_note="", verdict=rec, verdict_source="recorded", gpu_time=None,
                      gpu_time_source="none", importances=None, importance_note="")
    html = render_html(data)
    verdict = html.split('<section id="verdict">', 1)[1].split("</section>")[0].split("<div")[0]
    assert "at least 1.414x</b> (a bound, not a ratio)" in verdict
    assert "--capacity-max-s" in verdict
    shape_html = html.split('<section id="shape">', 1)[1].split("<div")[0]  # before its figure
    assert "replayed as open loop at the recorded 5.53 req/s" in shape_html
    assert "?" not in verdict + shape_html  # no placeholder left for a figure


# --- which rate is which (issue 66) --------------------------------------------------------


def test_a_level_reports_the_busiest_stretchs_rate_beside_the_mean_rate() -> None:
    # the held-out trace's level at 7.26 req/s mean sent 303 requests in 10.4 s (29 req/s)
    from autotune.report import level_rate
    from autotune.traffic import RequestSpec, Schedule
    from autotune.trial._levels import sent_rate

    reqs = tuple(RequestSpec(index=i, prompt_token_ids=(1, 2), max_tokens=26,
                             send_at_s=i * 10.4 / 302) for i in range(303))
    schedule = Schedule(mode="open", requests=reqs)
    assert sent_rate(schedule) == pytest.approx(302 / 10.4)
    assert sent_rate(Schedule(mode="open", requests=reqs[:1])) is None
    assert level_rate({"offered_rps": 7.26, "busiest_rps": 29.04}) == (
        "7.26 req/s mean (busiest stretch 29.0 req/s)")
    assert level_rate({"offered_rps": 7.26}) == "7.26 req/s mean"  # an older record


def test_the_capacity_line_says_whose_rate_its_tokens_per_second_are() -> None:
    from autotune.report import capacity_line

    block = {**_block(), "capacity_rps": 7.26, "capacity_rps_ci_low": 7.26,
             "capacity_rps_ci_high": 8.0, "output_tokens_per_s_at_capacity": 644.0,
             "busiest_rps_at_capacity": 29.0}
    line = capacity_line(block, "server")
    assert line.startswith("capacity: 7.26 req/s mean rate within the SLOs"), line
    assert ("its busiest stretch, which each level replays, sent 29.0 req/s at that mean "
            "rate: 644 out tok/s there") in line
    # the cost's output tokens a request yields: tokens/s over the rate that sent them
    from autotune.cost import rate_of

    metrics = {"capacity_rps": 7.26, "output_tokens_per_s_at_capacity": 644.0,
               "capacity_busiest_rps": 29.0}
    rate = rate_of(metrics, [7.26], 7.26, capacity=True)
    assert rate.output_tokens_per_request == pytest.approx(644.0 / 29.0)  # 22, not 89
