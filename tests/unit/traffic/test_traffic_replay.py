"""Replay schedules: deterministic, exact lengths, token ranges, arrivals, prefixes."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from autotune.errors import TrafficError
from autotune.traffic import (
    LoadSpec,
    Schedule,
    TraceRecords,
    TrafficShape,
    build_schedule,
    constant_shape,
    fit_shape,
    ideal_prefix_hit_fraction,
)

CASE = constant_shape(512, 512, load=LoadSpec(mode="closed", concurrency=256, requests=40))


def _lengths(s: Schedule) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([len(r.prompt_token_ids) for r in s.requests]),
        np.array([r.max_tokens for r in s.requests]),
    )


def test_fixed_lengths_are_exact() -> None:
    s = build_schedule(CASE, vocab_size=4096)
    assert s.mode == "closed" and s.concurrency == 256 and len(s.requests) == 40
    inp, out = _lengths(s)
    assert set(inp) == {512} and set(out) == {512}
    assert s.total_output_tokens() == 40 * 512
    assert all(r.send_at_s is None for r in s.requests)
    assert [r.index for r in s.requests] == list(range(40))


def test_output_jitter_spreads_closed_loop_lengths_around_the_shapes() -> None:
    exact = build_schedule(CASE, vocab_size=4096, num_requests=2000)
    s = build_schedule(CASE, vocab_size=4096, num_requests=2000, output_jitter=0.1)
    inp, out = _lengths(s)
    assert set(inp) == {512} and out.min() >= 461 and out.max() <= 563
    assert len(set(out.tolist())) > 90 and abs(out.mean() / 512 - 1) < 0.01
    # its own generator: the prompts (and every other draw) are the unjittered schedule's
    assert [r.prompt_token_ids for r in s.requests] == [r.prompt_token_ids for r in exact.requests]
    assert s == build_schedule(CASE, vocab_size=4096, num_requests=2000, output_jitter=0.1)
    assert s != build_schedule(CASE, vocab_size=4096, num_requests=2000, output_jitter=0.1,
                               seed=1)
    # the caps hold after the jitter: the server's context and max_output_tokens
    _, out = _lengths(build_schedule(CASE, vocab_size=4096, num_requests=200,
                                     output_jitter=0.5, max_total_tokens=900))
    assert out.max() <= 899
    _, out = _lengths(build_schedule(CASE, vocab_size=4096, num_requests=200,
                                     output_jitter=0.5, max_output_tokens=520))
    assert out.max() <= 520 and out.min() < 300
    # open loop: arrival times keep streams apart; its lengths stay the shape's
    opened = build_schedule(CASE, vocab_size=4096, num_requests=50, mode="open", rate_rps=2.0,
                            output_jitter=0.1)
    assert {r.max_tokens for r in opened.requests} == {512}
    for bad, mode in ((-0.1, "closed"), (1.0, "open")):
        with pytest.raises(TrafficError, match=r"output_jitter must be in \[0, 1\)"):
            build_schedule(CASE, vocab_size=4096, output_jitter=bad, mode=mode, rate_rps=2.0)


def test_token_ids_in_range() -> None:
    s = build_schedule(CASE, vocab_size=10, token_offset=4, num_requests=5)
    ids = np.concatenate([r.prompt_token_ids for r in s.requests])
    assert ids.min() >= 4 and ids.max() < 10 and len(set(ids.tolist())) == 6
    with pytest.raises(TrafficError, match="vocab_size 5 leaves no room"):
        build_schedule(CASE, vocab_size=5)


def test_deterministic_for_a_seed(azure_shape: TrafficShape) -> None:
    def run(seed: int) -> Schedule:
        return build_schedule(
            azure_shape, seed=seed, vocab_size=4096, num_requests=30, max_input_tokens=256
        )

    a, b, c = run(3), run(3), run(4)
    assert a == b and a != c and a.seed == 3


def test_lengths_follow_the_shape(azure_shape: TrafficShape) -> None:
    s = build_schedule(azure_shape, vocab_size=64, num_requests=3000, mode="closed", concurrency=4)
    inp, out = _lengths(s)
    assert np.median(inp) == pytest.approx(azure_shape.input_tokens.p50, rel=0.05)
    assert np.percentile(out, 99) == pytest.approx(azure_shape.output_tokens.p99, rel=0.1)
    assert inp.mean() == pytest.approx(azure_shape.input_tokens.mean, rel=0.1)


def test_rank_correlation_is_reproduced() -> None:
    rng = np.random.default_rng(0)
    x = rng.lognormal(6, 1, 4000)
    y = np.exp(0.7 * np.log(x) + rng.normal(0, 0.5, 4000))
    records = TraceRecords(
        path="corr",
        format="openai_log",
        timestamps_s=np.sort(rng.uniform(0, 600, 4000)),
        input_tokens=np.maximum(1, x.astype(np.int64)),
        output_tokens=np.maximum(1, y.astype(np.int64)),
    )
    shape = fit_shape(records)
    assert shape.correlation is not None and shape.correlation.spearman is not None
    s = build_schedule(shape, vocab_size=64, num_requests=3000, mode="closed", concurrency=1)
    inp, out = _lengths(s)
    assert sps.spearmanr(inp, out).statistic == pytest.approx(shape.correlation.spearman, abs=0.05)


def test_clipping(azure_shape: TrafficShape) -> None:
    s = build_schedule(
        azure_shape, vocab_size=64, num_requests=300, max_input_tokens=100, max_output_tokens=20
    )
    inp, out = _lengths(s)
    assert inp.max() == 100 and out.max() == 20 and inp.min() >= 1 and out.min() >= 1
    with pytest.raises(TrafficError, match="max_input_tokens must be > 0"):
        build_schedule(azure_shape, vocab_size=64, max_input_tokens=0)


@pytest.mark.parametrize("arrival", ["recorded", "gamma", "poisson"])
def test_open_loop_rate(azure_shape: TrafficShape, arrival: str) -> None:
    n = 2000
    s = build_schedule(
        azure_shape,
        vocab_size=64,
        num_requests=n,
        max_input_tokens=8,
        rate_rps=20.0,
        arrival=arrival,
    )
    t = np.array([r.send_at_s for r in s.requests])
    assert s.mode == "open" and t[0] == 0 and np.all(np.diff(t) >= 0)
    rate = n / t[-1]
    # "recorded" follows the recorded profile (its start is slower than the mean)
    assert rate == pytest.approx(20.0, rel=0.25 if arrival == "recorded" else 0.1)
    half = build_schedule(
        azure_shape,
        vocab_size=64,
        num_requests=n,
        max_input_tokens=8,
        rate_rps=20.0,
        arrival=arrival,
        time_scale=0.5,
    )
    assert half.requests[-1].send_at_s == pytest.approx(t[-1] / 2, rel=1e-6)


def test_gamma_matches_burstiness(azure_shape: TrafficShape) -> None:
    s = build_schedule(
        azure_shape, vocab_size=64, num_requests=5000, max_input_tokens=4, arrival="gamma"
    )
    gaps = np.diff([r.send_at_s for r in s.requests])
    assert azure_shape.arrivals is not None
    assert gaps.std() / gaps.mean() == pytest.approx(azure_shape.arrivals.interarrival_cv, rel=0.1)


def test_open_loop_needs_a_rate() -> None:
    with pytest.raises(TrafficError, match="no recorded arrival rate"):
        build_schedule(CASE, vocab_size=64, mode="open")
    s = build_schedule(CASE, vocab_size=64, mode="open", rate_rps=4.0, num_requests=3)
    assert s.mode == "open" and len(s.requests) == 3


def test_duration_caps_open_loop(azure_shape: TrafficShape) -> None:
    shape = azure_shape.with_load(LoadSpec(mode="open", requests=5000, duration_s=30.0))
    s = build_schedule(shape, vocab_size=64, max_input_tokens=4)
    assert 0 < len(s.requests) < 5000 and s.requests[-1].send_at_s <= 30.0


def test_prefix_sharing_is_reproduced(mooncake_shape: TrafficShape) -> None:
    assert mooncake_shape.prefix is not None
    s = build_schedule(
        mooncake_shape,
        vocab_size=4096,
        num_requests=60,
        max_input_tokens=8192,
        mode="closed",
        concurrency=8,
    )
    hit = ideal_prefix_hit_fraction(s, block_tokens=16)
    assert hit == pytest.approx(mooncake_shape.prefix.shared_token_fraction, abs=0.05)


def test_no_prefix_means_no_sharing(azure_shape: TrafficShape) -> None:
    s = build_schedule(azure_shape, vocab_size=4096, num_requests=50, max_input_tokens=512)
    assert ideal_prefix_hit_fraction(s) == 0.0
