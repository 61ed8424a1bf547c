"""The capacity pruner (pure): the bracketing search stops once a level fails below the
incumbent's capacity, and the study gives a capacity trial that bar."""

from __future__ import annotations

import pytest

from autotune.trial import CapacitySearch, Level, search_capacity


def _probe(true_scale: float, calls: list[float]):  # type: ignore[no-untyped-def]
    def probe(scale: float) -> Level:
        calls.append(scale)
        ok = scale <= true_scale
        return Level(scale=scale, offered_rps=scale, passed=ok,
                     goodput_fraction=1.0 if ok else 0.5, error_rate=0.0)
    return probe


def test_a_search_stops_at_the_first_level_failing_below_the_incumbent() -> None:
    full: list[float] = []
    whole = search_capacity(_probe(1.3, full), recorded_rps=2.0,
                            search=CapacitySearch(tolerance=0.1))
    calls: list[float] = []
    res = search_capacity(_probe(1.3, calls), recorded_rps=2.0,
                          search=CapacitySearch(tolerance=0.1), prune_below=3.0)
    assert res.status == "pruned" and whole.status == "found"
    assert calls == [1.0, 2.0]  # pass at 1x, fail at 2x < 3x: stop, no bisection
    assert len(full) > len(calls)
    assert res.low == 1.0 and res.high == 2.0 and res.ci_high_rps == 4.0
    assert "cannot win" in res.summary(CapacitySearch(tolerance=0.1))


@pytest.mark.parametrize("bar", [None, 1.0, 1.2])
def test_a_config_that_can_still_win_is_searched_to_the_end(bar: float | None) -> None:
    """A failing level at or above the bar prunes nothing (the incumbent's capacity could
    still be beaten): the bracket closes as without a bar."""
    calls: list[float] = []
    res = search_capacity(_probe(1.3, calls), recorded_rps=2.0,
                          search=CapacitySearch(tolerance=0.1), prune_below=bar)
    assert res.status == "found" and res.low is not None and res.high is not None
    assert res.high / res.low - 1 <= 0.1


def test_a_first_level_that_fails_below_the_bar_is_the_only_one() -> None:
    calls: list[float] = []
    seen: list[int] = []
    res = search_capacity(_probe(0.3, calls), recorded_rps=2.0, prune_below=1.5,
                          on_level=lambda lv, r: seen.append(len(r.levels)))
    assert calls == [1.0] and seen == [1] and res.status == "pruned" and res.low is None
