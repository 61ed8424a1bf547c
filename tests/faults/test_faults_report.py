"""Say why, where the user looks (issue 17): a study whose every trial is infeasible from
overload explains it on the console, in trials.csv, in MLflow and in its report; resumed,
the report shows the whole study. The fake engine of the fault suite serves the trials
(real HTTP, real loop, storage, MLflow and browser)."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from autotune.report import SECTIONS
from tests._browser import open_report
from tests.faults._lab import VERDICT_EXITS, Lab, run_cli

pytestmark = pytest.mark.faults


def test_all_infeasible_study_says_why_then_resumed_report(lab: Lab) -> None:
    # every third request fails with HTTP 500 in the first two servers; the third serves
    # (a third, not a half: from half of the requests failing on, a trial stops early as
    # 'aborted', tested in tests/integration/test_trial_abort.py)
    space = lab.space("fail:3,fail:3,ok")
    rc, out, err = run_cli(lab.argv(space, trials=2))
    assert rc == 1, err[-3000:]
    # the console: each trial's reason and message as it ends, and one paragraph at the end
    # (a measurement runs until precise, so it may end between a failed request and the
    # next served one: the rate is a third give or take one request's share)
    why = re.compile(r"infeasible \(errors\): error rate (3[1-5]\.\d)% > 5\.0% \(failed "
                     r"requests: http_5xx 100%\)")
    assert len(why.findall(err)) == 2, err[-3000:]
    assert re.search(
        r"no trial met the constraints: all 2 trials infeasible \(errors \(2\)\): 3[1-5] % of "
        r"requests failed \(limit --max-error-rate 5 %\), mostly http_5xx \(100% of the "
        r"failures: the server answered with internal errors\)\. The offered load "
        r"\(--concurrency 2\) is beyond what these servers serve", out), out
    assert "see the failure reasons above" not in out
    df = pd.read_csv(lab.out / "trials.csv")
    assert list(df["reason"]) == ["errors", "errors"]
    assert all("http_5xx" in m for m in df["message"])
    assert all(v > 0 for v in df["constraint.errors"])  # by how much the limit was missed
    runs = [r for r in lab.runs() if r.data.tags.get("autotune.kind") == "trial"]
    assert all(re.search(r"error rate (3[1-5]\.\d)%", r.data.tags["autotune.failure_message"])
               for r in runs)
    study_run = next(r for r in lab.runs() if r.data.tags.get("autotune.kind") == "study")
    assert "all 2 trials infeasible" in study_run.data.tags["autotune.no_winner_why"]
    with open_report(lab.out / "report.html") as page:
        assert page.sections() == [*SECTIONS, "config"]
        assert "all 2 trials infeasible" in page.text("#verdict")
        assert page.text("#failures").count("http_5xx 100%") == 2
        assert "infeasible" in page.hover_a_point("plot-history")
        assert page.errors == [] and page.requests == []

    # resumed with one more trial: it serves, and the report covers all three
    rc, out, err = run_cli(lab.argv(space, trials=3, extra=["--resume"]))
    assert rc in VERDICT_EXITS, err[-3000:]
    assert "best: trial 2" in out and "report: " in out
    with open_report(lab.out / "report.html") as page:
        assert page.sections() == [*SECTIONS, "config"]
        assert "3 trials (1 feasible, 2 infeasible, 0 failed)" in page.text("header")
        assert "trial #2" in page.text("#verdict")
        assert page.page.locator("#plot-history .scatterlayer .point").count() >= 3
        page.hover_a_point("plot-history")
        assert page.errors == [] and page.requests == []
