"""Session-causal replay against real CPU vLLM servers: a session's turns are causal,
each prompt extends the answer the server returned (its prefix-cache hit counter rises
with them, and stays near 0 for independent requests of the same lengths), and a server
with prefix caching hits where one without it cannot (cache hits, never speed). One shared
server with prefix caching (``tiny_server``) and one trial's server without it."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from autotune.config import MeasureSettings
from autotune.load import (
    RunResult,
    SessionSchedule,
    model_prompts,
    replay,
    session_schedule,
    snapshot_metrics,
)
from autotune.measure import allowed_misses, server_figures
from autotune.traffic import (
    LoadSpec,
    RequestSpec,
    Schedule,
    SessionStats,
    TrafficShape,
    constant_shape,
    length_dist,
)
from autotune.trial import TrialOutcome, TrialSpec, run_trial
from autotune.trial._replay import _plan
from autotune.trial._sessions import SessionTrial

pytestmark = pytest.mark.slow

TURNS, FIRST, NEW, OUT, THINK_S = 3, 256, 32, 16, 0.2


def _shape() -> TrafficShape:
    """Conversations of 3 turns: a 256-token first prompt, 32 new tokens a turn, 16-token
    answers, 0.2 s of think time, 6 sessions a second."""
    base = constant_shape(FIRST, OUT, load=LoadSpec(mode="open", rate_rps=18.0, requests=36),
                          name="chat-sessions")
    sessions = SessionStats(
        source="session_id", sessions=12, rate_sps=6.0, multi_turn_fraction=1.0,
        turns=length_dist([TURNS]), first_turn_tokens=length_dist([FIRST]),
        new_tokens=length_dist([NEW]), think_time_s=length_dist([THINK_S]),
        think_time_basis="answer")
    return base.model_copy(update={"sessions": sessions})


def _run(server: Any, sched: SessionSchedule | Schedule) -> tuple[RunResult, dict[str, float]]:
    before = snapshot_metrics(server.base_url)
    run = replay(sched, base_url=server.base_url, model=server.served_model_name)
    return run, server_figures(before, snapshot_metrics(server.base_url))


def test_turns_are_causal_and_extend_the_returned_answers(tiny_server: Any,
                                                          tiny_llama: Path) -> None:
    tokens = model_prompts(tiny_llama).token_ids
    sched = session_schedule(_shape(), token_ids=tokens, num_sessions=8, seed=1,
                             max_total_tokens=1024)
    run, fig = _run(tiny_server, sched)
    assert all(r.ok for r in run.records), [r.detail for r in run.records if not r.ok]
    assert len(run.records) == 8 * TURNS
    for s in range(8):
        turns = sorted((r for r in run.records if r.session == s), key=lambda r: r.turn or 0)
        assert [r.turn for r in turns] == list(range(TURNS))
        for prev, nxt in itertools.pairwise(turns):
            assert prev.end_s is not None
            assert nxt.send_s >= prev.end_s + THINK_S - 0.02  # never before the answer
            # the previous prompt + the answer's tokens + the new ones, as the server counts
            assert nxt.prompt_tokens == prev.prompt_tokens + prev.output_tokens + NEW
    # turns >= 2 find their session's earlier prompt and answer in the cache (in whole
    # blocks: 128 tokens on the CPU build, so not every reusable token hits)
    later = [r for r in run.records if (r.turn or 0) >= 1]
    reusable = sum((r.prompt_tokens or 0) - NEW for r in later)
    assert fig["prefix_cache_hits"] >= 0.6 * reusable, fig

    # the same prompt lengths as independent requests (fresh tokens): next to no hits
    rng = np.random.default_rng(5)
    indep = Schedule(mode="open", requests=tuple(
        RequestSpec(index=i, prompt_token_ids=tuple(
            int(t) for t in rng.choice(tokens, size=r.prompt_tokens or 1)),
            max_tokens=OUT, send_at_s=0.05 * i)
        for i, r in enumerate(run.records)))
    run2, fig2 = _run(tiny_server, indep)
    assert all(r.ok for r in run2.records)
    assert fig2["prefix_cache_hits"] <= 0.02 * fig2["prefix_cache_queries"], fig2
    assert fig["prefix_cache_hit_rate"] > 0.3 > fig2.get("prefix_cache_hit_rate", 0.0)


def _spec(tiny_llama: Path, flags: tuple[str, ...], log: Path) -> TrialSpec:
    measure = MeasureSettings(replay="sessions", warmup_requests=2, measure_max_s=6.0,
                              num_requests=30)
    return TrialSpec(number=0, model=str(tiny_llama), shape=_shape(), seed=2,
                     flags=("--max-model-len", "1024", "-O0", *flags), env={},
                     log_path=str(log), measure=measure)


def test_prefix_caching_on_beats_off_in_cache_hits(tiny_server: Any, tiny_llama: Path,
                                                   tmp_path: Path) -> None:
    # prefix caching on: the session trial mode on the shared server
    on_spec = _spec(tiny_llama, (), tmp_path / "on.log")
    client = {"base_url": tiny_server.base_url, "model": tiny_server.served_model_name,
              "api": "completions", "request_timeout_s": 120.0}
    outcome = TrialOutcome(number=0, ok=False)
    (on,) = SessionTrial().measure(on_spec, _plan(on_spec), tiny_server, outcome,
                                   lambda *_: None, client)  # type: ignore[arg-type]
    assert on.sessions["turns_per_session"] > 1 and on.n_errors == 0
    assert on.server["prefix_cache_hits"] > 0
    # off: a whole trial of its own server, chosen by --replay sessions
    off = run_trial(replace(_spec(tiny_llama, ("--no-enable-prefix-caching",),
                                  tmp_path / "off.log")))
    assert off.ok, off.message
    m = off.metrics
    assert m["session_turns_per_session"] > 1 and "session_ttft_p50_s_turn2" in m
    assert m.get("server_prefix_cache_hits", 0.0) == 0.0
    assert "server_kv_cache_usage_max" in m and "server_preemptions" in m
    assert on.server["prefix_cache_hit_rate"] > m.get("server_prefix_cache_hit_rate", 0.0)


def test_a_session_capacity_search_scales_the_session_rate(tiny_server: Any,
                                                           tiny_llama: Path) -> None:
    """Load levels of whole sessions on the shared server (prefix caching on): each level
    offers every turn of its sessions and is judged on them; the capacity is in sessions/s
    as well as requests/s (which level passes is the CPU's business: not asserted)."""
    from autotune.trial import MODES, mode_for
    from autotune.trial._levels import capacity_spec

    measure = MeasureSettings(warmup_requests=2, slo={"ttft_p99": 5.0})  # --replay auto
    spec = TrialSpec(number=0, model=str(tiny_llama), shape=_shape(), seed=2,
                     flags=("--max-model-len", "1024", "-O0"), env={}, measure=measure,
                     **capacity_spec(goodput=0.9, max_error_rate=0.05, start=1.0,
                                     tolerance=0.5, level_s=4.0, max_levels=3))
    plan = _plan(spec)
    mode = mode_for(spec, plan)
    assert mode is MODES["session_capacity"]  # auto: the shape has sessions and a rate
    client = {"base_url": tiny_server.base_url, "model": tiny_server.served_model_name,
              "api": "completions", "request_timeout_s": 120.0}
    outcome = TrialOutcome(number=0, ok=False)
    phases: list[str] = []
    results = mode.measure(spec, plan, tiny_server, outcome,
                           lambda _p, detail="": phases.append(detail), client)  # type: ignore[arg-type]
    cap = outcome.capacity
    assert cap is not None and cap["recorded_sps"] == 6.0 and cap["recorded_rps"] == 18.0
    levels = cap["levels"]
    assert 1 <= len(levels) <= 4  # 3, and the lowest again when none passed
    for lv in levels:
        # the turns of a window of the steady state: about the level's 40 requests
        n = lv["offered"]
        assert n >= 20, lv
        # judged on enough requests: misses credibly above 10 % (the binomial rule) fail it
        missed = n - round(lv["goodput_fraction"] * n)
        failed = round(lv["error_rate"] * n)
        assert lv["passed"] == (not lv["stopped_early"] and missed <= allowed_misses(n, 0.1)
                                and failed <= allowed_misses(n, 0.05)), lv
    assert any("sessions/s" in p for p in phases), phases
    assert "sessions/s" in (outcome.message or "")
    metrics = mode.metrics(spec, outcome)
    assert metrics["capacity_recorded_sps"] == 6.0
    if cap["low"] is None:  # no level met the SLOs: the outcome is whole, no measurement
        assert outcome.ok and not results and cap["capacity_sps"] is None
        return
    assert cap["capacity_sps"] == pytest.approx(cap["low"] * 6.0)
    assert metrics["capacity_sps"] == pytest.approx(cap["low"] * 6.0)
    assert metrics["capacity_rps"] == pytest.approx(cap["low"] * 18.0)
    # the level the capacity rests on was replayed turn by turn: its later turns hit the
    # prefix cache the earlier turns filled
    (m,) = results
    assert 1 < m.sessions["turns_per_session"] <= TURNS  # the window cuts some sessions
    assert m.server["prefix_cache_hits"] > 0, m.server


def test_a_session_level_ends_within_its_bound_although_think_times_are_minutes(
        tiny_server: Any, tiny_llama: Path) -> None:
    """Think times of two minutes, a level of 4 s: the level sends the turns that fall due
    in its window of the steady state (new sessions at the asked session rate, sessions
    already mid-conversation whose earlier turns its warm-up put into the cache) and ends,
    where a replay of whole sessions would wait out 4 minutes of think time."""
    from autotune.trial import CapacitySearch
    from autotune.trial._levels import LevelPlan, run_level
    from autotune.trial._sessions import SessionLevels

    base = _shape()
    assert base.sessions is not None
    long = base.model_copy(update={"sessions": base.sessions.model_copy(update={
        "think_time_s": length_dist([120.0]), "session_span_s": length_dist([240.0])})})
    levels = SessionLevels(shape=long, token_ids=tuple(model_prompts(tiny_llama).token_ids),
                           recorded_rps=18.0, recorded_sps=6.0, max_len=1024)
    plan = LevelPlan(level_s=4.0, seed=3)
    window = plan.seconds(18.0)
    sched = levels.level_at(plan)(18.0, 1)  # what the level at the scale 1 sends
    new = [x for x in sched.sessions if x.first_turn == 0]
    # the offered session and turn rates are the asked ones (a Poisson draw of ~24 and ~72)
    assert len(new) / window == pytest.approx(6.0, rel=0.5)
    assert sched.turns() / window == pytest.approx(18.0, rel=0.5)
    assert any(x.first_turn > 0 for x in sched.sessions)

    def no_build(**_: Any) -> Schedule:
        raise AssertionError("a session level draws its own schedule")

    client = {"base_url": tiny_server.base_url, "model": tiny_server.served_model_name,
              "api": "completions", "request_timeout_s": 120.0}
    level, m = run_level(1.0, recorded_rps=18.0, build=no_build, client_kw=client,  # type: ignore[arg-type]
                         slo=None, search=CapacitySearch(goodput=0.5), plan=plan,
                         token_seed=1, level_at=levels.level_at(plan))
    assert level.offered == sched.turns() and level.finished == level.offered, level
    # bounded: the window and the tail of its last requests, not 2 x 120 s of think time
    assert level.seconds < window + 60.0, level
    assert level.warmup_s > 0  # the conversations under way went into the cache first
    assert m is not None and m.sessions["turns"] == level.offered
    assert "ttft_p50_s_turn2" in m.sessions  # later turns keep their turn numbers
    # turns of sessions under way extend their primed conversation: cache hits
    assert m.server["prefix_cache_hits"] > 0, m.server


def test_replay_exact_reports_the_trace_hit_rate_beside_the_fitted_one(
        tiny_server: Any, tiny_llama: Path) -> None:
    """``--replay exact`` (the trial mode bench and tune run) on the shared server: the
    Mooncake excerpt's first 30 requests with their recorded blocks at 1/32 of their
    lengths, then the fitted sessions at the same scale; both hit rates come back."""
    from autotune.traffic import clip_shape, fit_shape, read_trace
    from autotune.trial import MODES, mode_for

    trace = Path(__file__).resolve().parents[1] / "data" / "traces" / (
        "mooncake_fast25_conversation.jsonl")
    shape = clip_shape(fit_shape(read_trace(trace), name="moon"), rate_scale=8.0)
    measure = MeasureSettings(replay="exact", trace=str(trace), num_requests=30,
                              exact_block_tokens=16, warmup_requests=2)
    spec = TrialSpec(number=0, model=str(tiny_llama), shape=shape, seed=1,
                     flags=("--max-model-len", "1024", "-O0"), env={}, measure=measure)
    plan = _plan(spec)
    mode = mode_for(spec, plan)
    assert mode is MODES["exact"]
    client = {"base_url": tiny_server.base_url, "model": tiny_server.served_model_name,
              "api": "completions", "request_timeout_s": 120.0}
    outcome = TrialOutcome(number=0, ok=False)
    (m,) = mode.measure(spec, plan, tiny_server, outcome, lambda *_: None, client)  # type: ignore[arg-type]
    assert m.n_requests == 30 and m.n_errors == 0
    assert m.server["prefix_cache_queries"] > 0
    assert 0.0 <= m.server["prefix_cache_hit_rate"] <= 1.0
    fitted = m.server["fitted_replay_prefix_cache_hit_rate"]
    assert 0.0 <= fitted <= 1.0 and m.server["fitted_replay_prefix_cache_queries"] > 0
    assert m.flat()["server_fitted_replay_prefix_cache_hit_rate"] == fitted
