"""Rollout: move live traffic behind vLLM's router to a tuned config, step by step, judged
on the servers' own ``/metrics``; promote it, or roll back at once. See docs/rollout.md.

:func:`run_rollout` drives a :class:`RouterClient` (``vllm-router``'s admin API) through the
steps of :func:`plan_steps`, compares the new servers with the old ones
(:func:`judge`) and records every step in a :class:`RolloutLog`.
"""

from __future__ import annotations

from autotune.rollout._compare import (
    METRICS,
    Judgement,
    MetricVerdict,
    ServerScrape,
    SideFigures,
    judge,
    parse_scrape,
    quantile_interval,
    side_figures,
)
from autotune.rollout._log import RolloutLog
from autotune.rollout._plan import DEFAULT_STEPS, Step, parse_steps, plan_steps
from autotune.rollout._router import RouterClient, RouterError
from autotune.rollout._run import ManagedServer, RolloutResult, run_rollout
from autotune.rollout._settings import RolloutSettings

__all__ = [
    "DEFAULT_STEPS",
    "METRICS",
    "Judgement",
    "ManagedServer",
    "MetricVerdict",
    "RolloutLog",
    "RolloutResult",
    "RolloutSettings",
    "RouterClient",
    "RouterError",
    "ServerScrape",
    "SideFigures",
    "Step",
    "judge",
    "parse_scrape",
    "parse_steps",
    "plan_steps",
    "quantile_interval",
    "run_rollout",
    "side_figures",
]
