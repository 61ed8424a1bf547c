"""The capacity pruner on a real CPU vLLM server (the session's shared server: no start of
its own): a search whose config cannot beat the incumbent stops at the first level that
fails below the incumbent's capacity, and says why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from autotune.measure import Slo
from autotune.traffic import Schedule
from autotune.trial import CapacitySearch, LevelPlan, find_capacity, recorded_rate
from tests._capacity import SHAPE
from tests.conftest import needs_vllm


@needs_vllm
@pytest.mark.slow
def test_a_capacity_search_that_cannot_beat_the_incumbent_stops_and_says_why(
        tiny_server: Any, tiny_llama: Path) -> None:
    from autotune.load import build_prompts
    from autotune.traffic import load_shape

    shape = load_shape(SHAPE)
    recorded = recorded_rate(shape)

    def build(**kw: Any) -> Schedule:
        return build_prompts(shape, model=tiny_llama, max_total_tokens=1024, **kw)  # type: ignore[no-any-return]

    client_kw = {"base_url": tiny_server.base_url, "model": tiny_server.model_name}
    search = CapacitySearch(tolerance=0.1, max_levels=6)
    # an incumbent that sustained 64x the recorded rate: no tiny CPU server comes near it
    res, m = find_capacity(recorded_rps=recorded, build=build, client_kw=client_kw,
                           slo=Slo(ttft_s=2.0, tpot_s=0.1), search=search,
                           plan=LevelPlan(level_s=4.0, min_requests=8), prune_below=64.0)
    assert res.status == "pruned", res.summary(search)
    failed = [lv for lv in res.levels if not lv.passed]
    # it stopped at the first failing level: no bisection after it, whatever the tolerance
    assert len(failed) == 1 and res.levels[-1] is failed[0], res.to_dict()
    assert res.high is not None and res.high < 64.0
    assert all(lv.passed for lv in res.levels[:-1])
    assert (m is not None) == (res.low is not None)
    assert "cannot win" in res.summary(search)
