"""The rollout's pure parts: the step plan, quantile intervals from histograms, the judge. (the pure part: no server, no subprocess; the rest is tests/integration/test_rollout_logic.py)"""

from __future__ import annotations

import math

import pytest

from autotune.errors import ConfigError
from autotune.rollout import (
    judge,
    parse_scrape,
    parse_steps,
    plan_steps,
    quantile_interval,
    side_figures,
)
from autotune.traffic import Histogram
from tests._rollout_logic import BOUNDS


def _hist(values: list[float]) -> Histogram:
    counts = [0.0] * (len(BOUNDS) + 1)
    for v in values:
        i = next((k for k, b in enumerate(BOUNDS) if v <= b), len(BOUNDS))
        counts[i] += 1
    return Histogram(BOUNDS, tuple(counts), sum(values), float(len(values)))


def _page(values: list[float], *, ok: int, aborted: int = 0, tokens: int = 0,
          running: int = 0) -> str:
    """A vLLM /metrics page with the same latency in the three histograms."""
    lines = []
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens"):
        h = _hist(values)
        lines.append(f"# TYPE {name} histogram")
        cum = 0.0
        for b, c in zip([*BOUNDS, math.inf], h.counts, strict=True):
            cum += c
            le = "+Inf" if math.isinf(b) else repr(b)
            lines.append(f'{name}_bucket{{le="{le}",model_name="m"}} {cum}')
        lines.append(f'{name}_sum{{model_name="m"}} {h.sum}')
        lines.append(f'{name}_count{{model_name="m"}} {h.count}')
    lines += [
        "# TYPE vllm:request_success_total counter",
        f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {ok}',
        f'vllm:request_success_total{{finished_reason="abort",model_name="m"}} {aborted}',
        "# TYPE vllm:generation_tokens_total counter",
        f'vllm:generation_tokens_total{{model_name="m"}} {tokens}',
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{model_name="m"}} {running}',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="m"} 0',
    ]
    return "\n".join(lines) + "\n"


def test_steps_parse_and_reject() -> None:
    assert parse_steps("1,50%,100%") == [("1", 1), ("50%", 0.5), ("100%", 1.0)]
    for bad in ("0", "150%", "x", "", "1,,2"):
        with pytest.raises(ConfigError, match="--steps"):
            parse_steps(bad)


def test_plan_one_old_one_new_compares_then_switches() -> None:
    plan = plan_steps(old=["http://o"], new=["http://n"])
    assert [(s.new, s.old, s.final) for s in plan] == [
        (("http://n",), ("http://o",), False), (("http://n",), (), True)]


def test_plan_four_servers_one_then_half_then_all() -> None:
    old = [f"http://o{i}" for i in range(4)]
    new = [f"http://n{i}" for i in range(4)]
    plan = plan_steps(old=old, new=new)
    assert [(len(s.new), len(s.old)) for s in plan] == [(1, 3), (2, 2), (4, 0)]
    assert plan[-1].final and not plan[0].final


def test_plan_refuses_overlap_and_empty_sides() -> None:
    with pytest.raises(ConfigError, match="both an old and a new"):
        plan_steps(old=["http://a"], new=["http://a"])
    with pytest.raises(ConfigError, match="no old server"):
        plan_steps(old=[], new=["http://a"])


def test_quantile_interval_contains_the_true_median_and_narrows() -> None:
    import random

    rng = random.Random(0)
    small = _hist([rng.uniform(0.05, 0.5) for _ in range(40)])
    big = _hist([rng.uniform(0.05, 0.5) for _ in range(4000)])
    _, lo_s, hi_s = quantile_interval(small, 0.5)  # type: ignore[misc]
    _, lo_b, hi_b = quantile_interval(big, 0.5)  # type: ignore[misc]
    assert lo_s <= 0.275 <= hi_s and lo_b <= 0.3 and hi_b >= 0.2
    assert hi_b - lo_b < hi_s - lo_s
    # p99 of 40 requests: the upper rank is past the last one: no upper bound yet
    assert math.isinf(quantile_interval(small, 0.99)[2])  # type: ignore[index]
    assert quantile_interval(Histogram(BOUNDS, (0.0,) * 10, 0.0, 0.0), 0.5) is None


def _sides(new_vals: list[float], old_vals: list[float], *, new_aborted: int = 0):  # type: ignore[no-untyped-def]
    empty = parse_scrape(_page([], ok=0), taken_at=0.0)
    new = parse_scrape(_page(new_vals, ok=len(new_vals) - new_aborted, aborted=new_aborted,
                             tokens=100), taken_at=10.0)
    old = parse_scrape(_page(old_vals, ok=len(old_vals), tokens=100), taken_at=10.0)
    return side_figures([(empty, new)]), side_figures([(empty, old)])


def test_judge_passes_the_same_config_and_rolls_back_a_clearly_worse_one() -> None:
    import random

    rng = random.Random(1)
    same = [rng.uniform(0.05, 0.09) for _ in range(400)]
    other = [rng.uniform(0.05, 0.09) for _ in range(400)]
    new, old = _sides(same, other)
    assert new.output_tokens_per_s == pytest.approx(10.0)
    j = judge(new, old, metrics=["ttft_p50", "e2e_p50"], tolerance=0.5, error_tolerance=0.05,
              min_requests=30)
    assert j.decision == "pass", j.why
    slow = [v * 8 for v in same]
    new, old = _sides(slow, other)
    j = judge(new, old, metrics=["ttft_p50", "e2e_p50"], tolerance=0.5, error_tolerance=0.05,
              min_requests=30)
    assert j.decision == "regress" and "ttft_p50" in j.why
    ratio = next(v for v in j.verdicts if v.metric == "ttft_p50")
    assert ratio.low is not None and ratio.low > 1.5


def test_judge_waits_for_enough_requests_and_judges_errors() -> None:
    vals = [0.07] * 20
    new, old = _sides(vals, vals)
    j = judge(new, old, metrics=["ttft_p50"], tolerance=0.5, error_tolerance=0.05,
              min_requests=30)
    assert j.decision == "undecided" and "30 needed" in j.why
    vals = [0.07] * 300
    new, old = _sides(vals, vals, new_aborted=150)
    j = judge(new, old, metrics=["ttft_p50"], tolerance=0.5, error_tolerance=0.05,
              min_requests=30)
    assert j.decision == "regress" and "errors" in j.why


def test_parse_scrape_reads_reasons_gauges_and_rejects_non_vllm() -> None:
    s = parse_scrape(_page([0.1, 0.2], ok=5, aborted=2, tokens=70, running=3), taken_at=1.0)
    assert (s.finished, s.errors, s.output_tokens, s.running) == (7.0, 2.0, 70.0, 3.0)
    assert "vllm:time_to_first_token_seconds" in s.histograms
    from autotune.errors import TrafficError

    with pytest.raises(TrafficError):
        parse_scrape("# TYPE foo counter\nfoo_total 1\n", taken_at=0.0)
