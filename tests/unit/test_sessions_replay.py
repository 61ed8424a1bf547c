"""Session-causal and exact replay, the pure parts: sessions drawn from a shape, turn
scheduling, hash-id blocks, the session figures and how a trial picks its replay
(autotune.load._sessions, autotune.load._exact, autotune.measure._sessions,
autotune.trial._sessions)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from autotune.config import MeasureSettings
from autotune.errors import ConfigError, LoadgenError, TrafficError
from autotune.load import (
    RequestRecord,
    SessionSchedule,
    block_token_ids,
    exact_schedule,
    next_send_at,
    read_hash_trace,
    session_horizon,
    session_schedule,
    steady_sessions,
)
from autotune.load._modes import driver_for
from autotune.load._sessions import Session, SessionLoop, Turn
from autotune.measure import session_figures
from autotune.records import CapacityDeclared
from autotune.report import capacity_line
from autotune.traffic import Schedule, TrafficShape, fit_shape, read_trace
from autotune.trial import MODES, CapacitySearch, TrialSpec, mode_for
from autotune.trial._capacity import CapacityResult, Level
from autotune.trial._levels import LevelPlan
from autotune.trial._open_trial import _capacity_metrics
from autotune.trial._replay import _Plan
from autotune.trial._sessions import SessionLevels

MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "traces" / (
    "mooncake_fast25_conversation.jsonl")
TOKENS = tuple(range(100, 400))


@pytest.fixture(scope="module")
def shape() -> TrafficShape:
    return fit_shape(read_trace(MOONCAKE), name="mooncake")


def test_sessions_are_drawn_from_the_shape(shape: TrafficShape) -> None:
    s = shape.sessions
    assert s is not None
    sched = session_schedule(shape, token_ids=TOKENS, num_sessions=400, seed=3)
    again = session_schedule(shape, token_ids=TOKENS, num_sessions=400, seed=3)
    assert sched == again  # deterministic
    turns = [len(x.turns) for x in sched.sessions]
    assert 1 <= min(turns) and max(turns) <= s.turns.max
    assert np.mean(turns) == pytest.approx(s.turns.mean, rel=0.25)
    firsts = [len(x.turns[0].new_token_ids) for x in sched.sessions]
    assert np.mean(firsts) == pytest.approx(s.first_turn_tokens.mean, rel=0.3)
    assert all(x.turns[0].think_s == 0.0 for x in sched.sessions)
    later = [t.think_s for x in sched.sessions for t in x.turns[1:]]
    assert later and min(later) >= 0 and np.median(later) > 0
    starts = [x.start_s for x in sched.sessions]
    assert starts[0] == 0.0 and all(b is not None and a is not None and b >= a
                                    for a, b in itertools.pairwise(starts))
    # open loop at the recorded session rate
    assert len(starts) / (starts[-1] or 1.0) == pytest.approx(s.rate_sps, rel=0.2)
    ids = {i for x in sched.sessions for t in x.turns for i in t.new_token_ids}
    assert ids <= set(TOKENS)
    assert sched.think_basis == s.think_time_basis


def test_scales_closed_loop_and_other_words(shape: TrafficShape) -> None:
    base = session_schedule(shape, token_ids=TOKENS, num_sessions=50)
    small = session_schedule(shape, token_ids=TOKENS, num_sessions=50, length_scale=1 / 32,
                             time_scale=0.5)
    n_base = sum(len(t.new_token_ids) for x in base.sessions for t in x.turns)
    n_small = sum(len(t.new_token_ids) for x in small.sessions for t in x.turns)
    assert n_small == pytest.approx(n_base / 32, rel=0.1)
    assert small.sessions[-1].start_s == pytest.approx(0.5 * (base.sessions[-1].start_s or 0))
    closed = session_schedule(shape, token_ids=TOKENS, num_sessions=10, mode="closed",
                              concurrency=3)
    assert closed.mode == "closed" and all(x.start_s is None for x in closed.sessions)
    other = session_schedule(shape, token_ids=TOKENS, num_sessions=50, token_seed=7)
    assert [len(t.new_token_ids) for x in other.sessions for t in x.turns] == \
        [len(t.new_token_ids) for x in base.sessions for t in x.turns]
    assert other.sessions[0].turns[0].new_token_ids != base.sessions[0].turns[0].new_token_ids


def test_no_sessions_or_bad_arguments_are_one_clear_error(shape: TrafficShape) -> None:
    bare = shape.model_copy(update={"sessions": None})
    with pytest.raises(TrafficError, match="no sessions section"):
        session_schedule(bare, token_ids=TOKENS)
    with pytest.raises(TrafficError, match="concurrency"):
        session_schedule(shape, token_ids=TOKENS, mode="closed")
    with pytest.raises(TrafficError, match="length_scale"):
        session_schedule(shape, token_ids=TOKENS, length_scale=0)


def test_a_turn_is_sent_after_the_answer_and_its_think_time() -> None:
    assert next_send_at("answer", 1.0, 3.0, 2.0) == 5.0
    assert next_send_at("arrival", 1.0, 3.0, 5.0) == 6.0  # the gap counts from the send
    assert next_send_at("arrival", 1.0, 3.0, 0.5) == 3.0  # never before the answer


def test_the_driver_of_a_session_schedule(shape: TrafficShape) -> None:
    sched = session_schedule(shape, token_ids=TOKENS, num_sessions=5)
    driver = driver_for(sched)
    assert isinstance(driver, SessionLoop) and driver.mode == "open"
    assert len(driver.requests) == sched.turns()
    with pytest.raises(LoadgenError, match="session replay"):
        driver_for(sched, stagger=True)
    with pytest.raises(LoadgenError, match="no session"):
        driver_for(SessionSchedule(sessions=()))


def _moon(tmp_path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                        "hash_ids": h}) + "\n" for t, i, o, h in rows))
    return path


def test_exact_replay_builds_prompts_from_blocks(tmp_path: Path) -> None:
    path = _moon(tmp_path, [(1000, 1024, 512, [0, 1]), (4000, 1500, 64, [0, 1, 2]),
                            (4000, 700, 32, [0, 5])])
    reqs = read_hash_trace(path)
    sched = exact_schedule(reqs, token_ids=TOKENS, block_tokens=16, time_scale=0.5)
    a, b, c = (r.prompt_token_ids for r in sched.requests)
    table = np.asarray(TOKENS)
    blk = [tuple(block_token_ids(h, 16, table).tolist()) for h in (0, 1, 2, 5)]
    assert a == blk[0] + blk[1]  # 1024 / 512 * 16 = 32 tokens: two whole blocks
    assert len(b) == round(1500 / 32) and b[:32] == a and b[32:47] == blk[2][:15]  # cut
    assert len(c) == round(700 / 32) and c[:16] == blk[0] and c[16:] == blk[3][:6]
    assert [r.max_tokens for r in sched.requests] == [16, 2, 1]
    assert [r.send_at_s for r in sched.requests] == [0.0, 1.5, 1.5]
    padded = exact_schedule([replace(reqs[0], input_length=2048)], token_ids=TOKENS)
    p = padded.requests[0].prompt_token_ids
    assert len(p) == 64 and p[:32] == a  # padded beyond its blocks with tokens of its own
    clipped = exact_schedule(reqs[:1], token_ids=TOKENS, max_total_tokens=20)
    r0 = clipped.requests[0]
    assert r0.max_tokens + len(r0.prompt_token_ids) <= 20 and r0.prompt_token_ids == a[:4]


def test_a_bad_hash_trace_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                    '{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(TrafficError, match="line 2"):
        read_hash_trace(path)


def _rec(i: int, session: int | None, turn: int | None, send: float, first: float,
         end: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=i, send_s=send, first_token_s=first, end_s=end,
                         chunk_times_s=(first, end), chunk_tokens=(1, 1), prompt_tokens=10,
                         output_tokens=2, ok=ok, error=None if ok else "http_5xx",
                         detail=None, status=200, session=session, turn=turn)


def test_session_figures() -> None:
    recs = [_rec(0, 0, 0, 0.0, 0.5, 1.0), _rec(1, 0, 1, 2.0, 2.1, 3.0),
            _rec(2, 1, 0, 1.0, 1.3, 2.0), _rec(3, 1, 1, 4.0, 4.2, 5.0, ok=False),
            _rec(4, 2, 0, 1.0, 1.4, 1.5), _rec(5, 2, 4, 6.0, 6.1, 7.0)]
    f = session_figures(recs, wall_s=10.0)
    assert f["sessions"] == 3 and f["turns"] == 6 and f["failed_sessions"] == 1
    assert f["ttft_p50_s_turn1"] == pytest.approx(0.4)
    assert f["ttft_p50_s_turn2"] == pytest.approx(0.1)
    assert f["ttft_p50_s_turn4plus"] == pytest.approx(0.1)
    assert f["session_s_p50"] == pytest.approx(4.5)  # 3.0 and 6.0: session 1 failed
    assert f["sessions_per_s"] == pytest.approx(0.3)
    assert session_figures([_rec(0, None, None, 0.0, 0.1, 0.2)]) == {}


def _spec(shape: TrafficShape | None, **measure: object) -> TrialSpec:
    return TrialSpec(number=0, model="m", flags=(), env={}, shape=shape,
                     measure=MeasureSettings(**measure))  # type: ignore[arg-type]


def test_a_trial_replays_sessions_when_asked_or_auto(shape: TrafficShape) -> None:
    plan = _Plan(vocab=100, max_len=2048, schedule=Schedule(mode="open", requests=()))
    bare = shape.model_copy(update={"sessions": None})
    assert mode_for(_spec(shape), plan) is MODES["sessions"]  # auto
    assert mode_for(_spec(shape, replay="independent"), plan).name == "open"
    assert mode_for(_spec(bare), plan).name == "open"  # old shapes: as before
    assert mode_for(_spec(shape, api="chat"), plan).name == "open"  # auto: completions only
    # a capacity search over sessions: asked, or auto on a shape with a session rate
    cap = replace(_spec(shape), capacity=CapacitySearch())
    assert mode_for(cap, plan) is MODES["session_capacity"]
    asked = replace(_spec(shape, replay="sessions"), capacity=CapacitySearch())
    assert mode_for(asked, plan) is MODES["session_capacity"]
    indep = replace(_spec(shape, replay="independent"), capacity=CapacitySearch())
    assert mode_for(indep, plan).name == "capacity"
    assert mode_for(replace(_spec(bare), capacity=CapacitySearch()), plan).name == "capacity"
    no_rate = shape.model_copy(update={"sessions": shape.sessions.model_copy(  # type: ignore[union-attr]
        update={"rate_sps": 0.0})})
    assert mode_for(replace(_spec(no_rate), capacity=CapacitySearch()),
                    plan).name == "capacity"  # auto: a session search needs a session rate
    for spec, why in ((_spec(bare, replay="sessions"), "no sessions section"),
                      (_spec(shape, replay="sessions", api="chat"), "--api completions")):
        with pytest.raises(ConfigError, match=why):
            mode_for(spec, plan)


def test_replay_exact_picks_its_mode_or_says_what_is_missing(shape: TrafficShape,
                                                              tmp_path: Path) -> None:
    from autotune.cli._bench import _print_exact

    plan = _Plan(vocab=100, max_len=2048, schedule=Schedule(mode="open", requests=()))
    spec = _spec(shape, replay="exact", trace=str(MOONCAKE))
    assert mode_for(spec, plan) is MODES["exact"]
    for bad, why in ((_spec(shape, replay="exact"), "give it with --trace FILE"),
                     (_spec(shape, replay="exact", trace=str(tmp_path / "none.jsonl")),
                      "no such file"),
                     (replace(spec, capacity=CapacitySearch()), "capacity search"),
                     (_spec(shape, replay="exact", trace=str(MOONCAKE), api="chat"),
                      "--api completions")):
        with pytest.raises(ConfigError, match=why) as err:
            mode_for(bad, plan)
        assert "\n" not in str(err.value)
    # the line bench prints: both hit rates, side by side
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _print_exact({"server_prefix_cache_hit_rate": 0.591,
                      "server_fitted_replay_prefix_cache_hit_rate": 0.243}, str(MOONCAKE))
        _print_exact({"server_prefix_cache_hit_rate": 0.5}, "t.jsonl")
    first, second = buf.getvalue().splitlines()
    assert first == ("prefix-cache hit rate  exact replay of mooncake_fast25_conversation.jsonl "
                     "59.1%; fitted session replay 24.3% (same server, same scale)")
    assert "fitted session replay n/a (the shape has no sessions" in second


def test_the_exact_and_the_fitted_replay_share_one_scale(
        shape: TrafficShape, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import autotune.load
    from autotune.trial._exact import exact_plan, fitted_plan

    monkeypatch.setattr(autotune.load, "model_prompts",
                        lambda _model: types.SimpleNamespace(token_ids=TOKENS))
    spec = _spec(shape, replay="exact", trace=str(MOONCAKE), num_requests=200,
                 exact_block_tokens=16)
    plan = _Plan(vocab=100, max_len=2048, schedule=Schedule(mode="open", requests=()))
    exact = exact_plan(spec, plan)
    fitted = fitted_plan(spec, plan, len(exact.requests))
    assert len(exact.requests) == 200  # --num-requests of the trace
    assert fitted is not None and fitted.turns() == pytest.approx(200, rel=0.3)
    # both at 16 / 512 = 1/32 of the recorded lengths
    ex = np.mean([len(r.prompt_token_ids) for r in exact.requests])
    fi = np.mean([len(x.turns[0].new_token_ids) for x in fitted.sessions])
    assert shape.sessions is not None
    assert fi == pytest.approx(shape.sessions.first_turn_tokens.mean / 32, rel=0.35)
    assert ex == pytest.approx(shape.input_tokens.mean / 32, rel=0.35)


def _turns(*shape: tuple[int, int]) -> tuple[Turn, ...]:
    return tuple(Turn(new_token_ids=(1,) * new, max_tokens=out) for new, out in shape)


def test_a_schedule_within_the_context_drops_what_its_replay_would_not_send() -> None:
    sessions = (Session(0, _turns((100, 20), (30, 20), (30, 20))),  # prompts 100, 150, 200
                Session(1, _turns((300, 10))),  # its first turn does not fit
                Session(2, _turns((10, 5), (5, 5))))
    full = SessionSchedule(sessions=sessions, max_total_tokens=200)
    kept = full.within_context()
    # turn 3 of session 0: prompt 200 + 20 out > 200; session 1 dropped; session 2 whole
    assert [(x.index, len(x.turns)) for x in kept.sessions] == [(0, 2), (2, 2)]
    assert kept.turns() == 4 and len(kept.requests) == 4
    assert replace(full, max_total_tokens=None).within_context().turns() == 6


def _due(sess: Session) -> list[float]:
    """When each turn of a steady-state session falls due (recorded gaps from its start)."""
    return list(itertools.accumulate((t.think_s for t in sess.turns),
                                     initial=sess.start_s or 0.0))[1:]


def test_session_capacity_levels_are_windows_of_the_steady_state(shape: TrafficShape) -> None:
    s = shape.sessions
    assert s is not None and shape.rate_rps
    levels = SessionLevels(shape=shape, token_ids=TOKENS, recorded_rps=shape.rate_rps,
                           recorded_sps=s.rate_sps, max_len=100_000)
    plan = LevelPlan(level_s=60.0, seed=4)
    at = levels.level_at(plan)
    rate = 2.0 * shape.rate_rps  # the scale 2
    window = plan.seconds(rate)
    sched = at(rate, 1)
    assert sched == at(rate, 1) and sched.mode == "open" and sched.duration_s is None
    # every turn falls due in the window; the turns are the steady state's: the level's
    # request rate, new sessions at the level's session rate
    assert all(0 <= d < window for x in sched.sessions for d in _due(x))
    assert sched.turns() / window == pytest.approx(rate, rel=0.2)
    new = [x for x in sched.sessions if x.first_turn == 0]
    assert len(new) / window == pytest.approx(2.0 * s.rate_sps, rel=0.2)
    assert all(not x.context and x.context_at_s is None for x in new)
    # sessions already mid-conversation extend what they said before the window
    mid = [x for x in sched.sessions if x.first_turn > 0]
    assert mid and all(x.context and (x.context_at_s or 0.0) < 0 for x in mid)
    primer = sched.context_primer()
    assert primer is not None and primer.mode == "closed"
    assert [p.turns[0].new_token_ids for p in primer.sessions] == [
        x.context for x in sorted(mid, key=lambda x: x.context_at_s or 0.0)]
    assert all(p.turns[0].max_tokens == 1 for p in primer.sessions)
    other = at(rate, 2)  # other words, the same conversations
    assert [len(x.turns) for x in other.sessions] == [len(x.turns) for x in sched.sessions]
    assert other.sessions[0].turns[0].new_token_ids != sched.sessions[0].turns[0].new_token_ids
    # a context that holds no first turn: one line
    tiny = replace(levels, max_len=1)
    with pytest.raises(ConfigError, match="fits the server's context"):
        tiny.level_at(plan)(rate, 1)


def test_a_level_is_bounded_whatever_the_think_times(shape: TrafficShape) -> None:
    """Think times of hours: a level still holds the window's turns and no more."""
    s = shape.sessions
    assert s is not None and s.think_time_s is not None and shape.rate_rps
    slow = s.think_time_s.model_copy(update={
        "quantiles": [q * 100 for q in s.think_time_s.quantiles],
        "max": s.think_time_s.max * 100})
    span = s.session_span_s.model_copy(update={"max": 7200.0}) if s.session_span_s else None
    long = shape.model_copy(update={"sessions": s.model_copy(update={
        "think_time_s": slow, "session_span_s": span})})
    sched = steady_sessions(long, token_ids=TOKENS, rate_sps=s.rate_sps, window_s=20.0,
                            seed=2)
    due = [d for x in sched.sessions for d in _due(x)]
    assert due and max(due) < 20.0
    # no session sends two turns: its next one is hours away
    assert all(len(x.turns) == 1 for x in sched.sessions)
    assert any(x.context for x in sched.sessions)  # some answer a conversation of hours ago
    assert session_horizon(long.sessions) == 7200.0  # type: ignore[arg-type]


def test_a_session_capacity_speaks_of_sessions_per_second() -> None:
    lv = Level(scale=1.0, offered_rps=6.0, passed=True, goodput_fraction=1.0, error_rate=0.0)
    res = CapacityResult(recorded_rps=6.0, recorded_sps=2.0, low=1.0, high=1.25,
                         status="found", levels=[lv])
    assert res.capacity_sps == 2.0 and res.ci_high_sps == 2.5 and res.capacity_rps == 6.0
    line = res.summary()
    assert line.startswith("capacity 2 sessions/s (6 req/s of turns") and "[2, 2.5] sessions/s" \
        in line, line
    cap = res.to_dict(0.99)
    assert (cap["recorded_sps"], cap["capacity_sps"], cap["ci_high_sps"]) == (2.0, 2.0, 2.5)
    m = _capacity_metrics(cap, None)
    assert m["capacity_sps"] == 2.0 and m["capacity_sps_ci_high"] == 2.5
    assert m["capacity_rps"] == 6.0 and m["capacity_recorded_sps"] == 2.0
    plain = CapacityResult(recorded_rps=6.0, low=1.0, high=1.25, levels=[lv])
    assert "recorded_sps" not in plain.to_dict() and "sessions" not in plain.summary()
    assert "capacity_sps" not in _capacity_metrics(plain.to_dict(), None)
    # best.json's capacity line (tune's summary, bench, best) leads with sessions/s
    line = capacity_line(CapacityDeclared(capacity_rps=6.0, capacity_rps_ci_low=6.0,
                                          capacity_rps_ci_high=7.5, capacity_sps=2.0,
                                          recorded_rps=6.0, recorded_sps=2.0), "server")
    assert line.startswith("capacity: 2.00 sessions/s (6.00 req/s of turns) within the SLOs "
                           "(bracket [6.00, 7.50] req/s = [2.00, 2.50] sessions/s)"), line
    assert "sessions/s" not in capacity_line(CapacityDeclared(capacity_rps=6.0), "server")
    none = CapacityResult(recorded_rps=6.0, recorded_sps=2.0, high=1 / 64, status="none",
                          levels=[replace(lv, passed=False)])
    assert none.capacity_sps is None and "sessions/s" in none.summary()


def test_prefixes_shared_across_sessions_are_fitted_and_replayed(tmp_path: Path) -> None:
    """Three conversations open with the same two blocks (a system prompt and a document),
    a fourth with its own; the first one has a second turn. The sessions section keeps the
    sharing *between* sessions (their first turns'), not a session's reuse of itself, and
    the fitted replay starts the sharing sessions' first prompts with common tokens."""
    from autotune.traffic import compute_fingerprint

    path = _moon(tmp_path, [(0, 2048, 64, [0, 1, 10, 11]), (1000, 2048, 64, [0, 1, 20, 21]),
                            (2000, 2048, 64, [0, 1, 30, 31]), (3000, 1024, 64, [40, 41]),
                            (60000, 2560, 64, [0, 1, 10, 11, 12])])
    shape = fit_shape(read_trace(path), name="shared")
    s = shape.sessions
    assert s is not None and s.sessions == 4 and s.turns.max == 2
    p = s.shared_prefix
    assert p is not None and p.block_tokens == 512
    assert (p.sharing_request_fraction, p.groups, p.mean_group_size) == (0.75, 1, 3.0)
    assert p.shared_prefix_tokens is not None and p.shared_prefix_tokens.p50 == 1024
    # each of the three holds 2 blocks shared by 3: 2/3 of 1,024 tokens is a hit
    assert p.shared_token_fraction == pytest.approx(3 * 1024 * 2 / 3 / (3 * 2048 + 1024),
                                                    abs=1e-4)
    # a shape fitted before the key existed keeps its fingerprint
    bare = shape.model_copy(update={"sessions": s.model_copy(update={"shared_prefix": None})})
    dump = bare.model_dump()
    old = {**dump, "sessions": {k: v for k, v in dump["sessions"].items()
                                if k != "shared_prefix"}}
    assert compute_fingerprint(dump) == compute_fingerprint(old)
    assert compute_fingerprint(shape.model_dump()) != compute_fingerprint(dump)
    # the replay: sessions of the group start with the same tokens, at 1/32 of the lengths
    sched = session_schedule(shape, token_ids=TOKENS, num_sessions=200, seed=1,
                             length_scale=1 / 32)
    def sharing(heads: list[tuple[int, ...]]) -> float:
        """The share of sessions whose first 16 tokens another session starts with too."""
        return sum(heads.count(h) > 1 for h in heads) / len(heads)

    # 3 in 4 sessions join groups of 3 on average (200 / 4 x 3 / 3 = 50 groups)
    assert 0.5 <= sharing([x.turns[0].new_token_ids[:16] for x in sched.sessions]) <= 0.8
    none = session_schedule(bare, token_ids=TOKENS, num_sessions=200, seed=1,
                            length_scale=1 / 32)
    assert sharing([x.turns[0].new_token_ids[:16] for x in none.sessions]) == 0.0
    # the steady state's sessions too (first turns here, or the conversation before)
    steady = steady_sessions(shape, token_ids=TOKENS, rate_sps=4.0, window_s=30.0, seed=2)
    assert sharing([(x.context or x.turns[0].new_token_ids)[:16]
                    for x in steady.sessions]) >= 0.4


def test_a_steady_state_without_sessions_in_its_window_is_empty(shape: TrafficShape) -> None:
    none = steady_sessions(shape, token_ids=TOKENS, rate_sps=1e-9, window_s=1.0)
    assert none.sessions == () and none.context_primer() is None
    with pytest.raises(TrafficError, match="must be > 0"):
        steady_sessions(shape, token_ids=TOKENS, rate_sps=0.0, window_s=1.0)
