"""The busiest stretch of a recorded rate profile (autotune.traffic.busiest_stretch) and the
capacity levels' arrivals drawn from it (build_schedule(busiest=True)): pure."""

from __future__ import annotations

import pytest

from autotune.traffic import busiest_stretch, build_schedule, load_shape
from tests.conftest import REPO


def test_the_stretch_is_the_shortest_that_holds_the_requests() -> None:
    prof = [1.0, 0.0, 0.0, 9.0, 3.0]  # req/s per 60-s window
    # 40 requests fit in the 9-req/s window: it starts where that window does (60 + 0 + 0)
    assert busiest_stretch(prof, 60.0, 40) == pytest.approx(60.0)
    # 600 do not (540 in it): the stretch ends 60 requests into the next window
    assert busiest_stretch(prof, 60.0, 600) == pytest.approx(60.0)
    # as many as the whole profile holds, or more: from its start
    assert busiest_stretch(prof, 60.0, 780) == 0.0 and busiest_stretch(prof, 60.0, 1e6) == 0.0


def test_a_stretch_may_wrap_around_the_profiles_end() -> None:
    # windows of 5, 0, 0, 4 req/s: 400 requests take 85 s from 440 (inside the last window)
    # through the first window of the next period, 92 s from the last window's start
    assert busiest_stretch([5.0, 0.0, 0.0, 4.0], 60.0, 400) == pytest.approx(440.0)


def test_a_level_replays_the_busiest_stretch_not_the_recordings_start() -> None:
    # the Azure conversation shape: its first minute is its quietest (3.18 req/s), its
    # busiest 5.88; a level of 60 requests at the recorded mean replays the busiest
    shape = load_shape(REPO / "traffic" / "azure-conv.json")
    prof = shape.arrivals.rate_profile  # type: ignore[union-attr]

    def span(busiest: bool) -> float:
        s = build_schedule(shape, vocab_size=1000, mode="open", num_requests=60,
                           rate_rps=shape.rate_rps, seed=3, busiest=busiest)
        assert len(s.requests) == 60 and s.requests[0].send_at_s == 0.0
        return float(s.requests[-1].send_at_s or 0.0)

    mean = sum(prof) / len(prof)
    # 60 arrivals at the busiest window's rate (Poisson: within 30 %)
    assert 59 / span(True) == pytest.approx(max(prof) * shape.rate_rps / mean, rel=0.3)
    assert span(True) < span(False)
    # a shape without a profile is not changed by it
    same = [build_schedule(shape, vocab_size=1000, mode="open", num_requests=20, seed=1,
                           arrival="poisson", busiest=b) for b in (False, True)]
    assert same[0] == same[1]
