"""Sessions in the shape: turns, think time and context growth fitted from traces that link
turns (``session_id``, ``parent_chat_id``, ``hash_ids``), shown, compared, and broken links
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autotune.errors import TraceFormatError
from autotune.traffic import (
    SessionStats,
    TrafficShape,
    clip_shape,
    compute_fingerprint,
    diff_shapes,
    fit_shape,
    load_shape,
    read_trace,
    save_shape,
)
from tests._traffic_cli import REPO, _run

T0 = 1_700_000_000.0


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sessions(path: Path, fmt: str | None = None) -> SessionStats:
    s = fit_shape(read_trace(path, format=fmt)).sessions
    assert s is not None
    return s


def _log(sid: str | None, t: float, inp: int, out: int, lat: float) -> dict[str, object]:
    row: dict[str, object] = {"timestamp": T0 + t, "prompt_tokens": inp,
                              "completion_tokens": out, "latency_s": lat}
    if sid is not None:
        row["session_id"] = sid
    return row


@pytest.fixture
def openai_log(tmp_path: Path) -> Path:
    # session a: think 5-0-2 = 3 s, 8.5-5-3 = 0.5 s; session b: sent 0.5 s before the
    # answer of its first turn came back; one request without a session
    return _jsonl(tmp_path / "log.jsonl", [
        _log("b", 1.5, 70, 5, 1.0),
        _log("a", 0.0, 100, 20, 2.0),
        _log("a", 8.5, 200, 10, 1.0),
        _log(None, 2.0, 40, 4, 1.0),
        _log("b", 1.0, 50, 10, 1.0),
        _log("a", 5.0, 150, 30, 3.0),
    ])


def test_openai_log_sessions(openai_log: Path) -> None:
    s = _sessions(openai_log)
    assert (s.source, s.sessions, s.think_time_basis) == ("session_id", 3, "answer")
    assert sorted(s.turns.quantiles[::50]) == [1, 2, 3] and s.turns.mean == 2
    assert s.multi_turn_fraction == pytest.approx(2 / 3, abs=1e-5)
    assert s.rate_sps == pytest.approx(3 / 8.5, rel=1e-5)
    assert s.think_time_s is not None and s.new_tokens is not None
    assert s.context_growth is not None
    # think times 3, 0.5 and -0.5 (stored as 0: sent before the answer)
    assert (s.think_time_s.min, s.think_time_s.p50, s.think_time_s.max) == (0, 0.5, 3)
    assert s.in_flight_fraction == pytest.approx(1 / 3, abs=1e-5)
    assert s.quick_chain_fraction == pytest.approx(2 / 3, abs=1e-5)
    # new tokens 150-120, 200-180, 70-60; growth 50, 50, 20
    assert (s.new_tokens.min, s.new_tokens.mean, s.new_tokens.max) == (10, 20, 30)
    assert s.context_growth.mean == 40 and s.first_turn_tokens.mean == pytest.approx(63.3333)
    assert s.context_by_turn == pytest.approx([190 / 3, 110, 200], rel=1e-5)
    assert (s.fanout_fraction, s.max_fanout) == (0, 1)


def test_the_same_log_without_latencies_measures_gaps(tmp_path: Path, openai_log: Path) -> None:
    rows = [json.loads(x) for x in openai_log.read_text().splitlines()]
    for r in rows:
        del r["latency_s"]
    s = _sessions(_jsonl(tmp_path / "nolat.jsonl", rows))
    assert s.think_time_basis == "arrival" and s.in_flight_fraction is None
    assert s.think_time_s is not None
    assert sorted(s.think_time_s.quantiles[::50]) == [0.5, 3.5, 5]


def _turn(chat: object, parent: object, t: float, inp: int, out: int,
          **extra: object) -> dict[str, object]:
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": t,
            "input_length": inp, "output_length": out, "type": "text", **extra}


@pytest.fixture
def multi_turn(tmp_path: Path) -> Path:
    # session 1: 1 -> (2 -> 4 -> [5 failed] -> 6), 1 -> 3 (two next turns of 1); session 10
    return _jsonl(tmp_path / "chats.jsonl", [
        _turn(4, 2, 10.0, 150, 5, turn=3),
        _turn(1, -1, 0.0, 100, 20, turn=1),
        _turn(2, 1, 4.0, 130, 10, turn=2),
        _turn(10, -1, 3.0, 60, 6, turn=1),
        _turn(3, 1, 6.0, 125, 5, turn=2),
        _turn(5, 4, 12.0, 160, 0, turn=4),
        _turn(6, 5, 15.0, 170, 5, turn=5),
    ])


def test_multi_turn_trace_sessions(multi_turn: Path) -> None:
    records = read_trace(multi_turn)
    assert records.format == "multi_turn" and len(records) == 6 and records.failed == 1
    s = _sessions(multi_turn)
    assert (s.source, s.sessions, s.think_time_basis) == ("parent_id", 2, "arrival")
    assert (s.turns.min, s.turns.max) == (1, 5)
    assert s.think_time_s is not None
    # gaps: 2 after 1: 4 s, 3 after 1: 6 s, 4 after 2: 6 s, 6 after 4 (past the failed 5): 5 s
    assert s.think_time_s.mean == 5.25 and s.think_time_s.min == 4
    assert s.context_by_turn == [80, 127.5, 150, 170]
    assert (s.fanout_fraction, s.max_fanout) == pytest.approx((1 / 3, 2), abs=1e-5)
    assert s.quick_chain_fraction == 0 and s.in_flight_fraction is None
    shape = fit_shape(records)
    assert shape.prefix is not None and shape.prefix.source == "session"


def test_multi_turn_file_order_does_not_matter(multi_turn: Path, tmp_path: Path) -> None:
    lines = multi_turn.read_text().splitlines()
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("\n".join(reversed(lines)) + "\n")
    a, b = fit_shape(read_trace(multi_turn)), fit_shape(read_trace(shuffled))
    assert a.sessions == b.sessions and a.fingerprint == b.fingerprint


def _moon(t_ms: int, inp: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": t_ms, "input_length": inp, "output_length": 10, "hash_ids": ids}


def test_hash_id_turns(tmp_path: Path) -> None:
    """B holds A's complete blocks (A's last block is partial, so B's id there differs), E
    holds B's: one session A -> B -> E. Block 0 is in every request (a system prompt): C and
    D share only it, so they are sessions of their own, and so are F, G, H."""
    path = _jsonl(tmp_path / "moon.jsonl", [
        _moon(0, 1600, [0, 1, 2, 3]),
        _moon(10_000, 2100, [0, 1, 2, 4, 5]),
        _moon(12_000, 700, [0, 6]),
        _moon(20_000, 900, [0, 6, 7]),
        _moon(30_000, 2600, [0, 1, 2, 4, 8, 9]),
        *(_moon(40_000 + i, 600, [0, 10 + i]) for i in range(3)),
    ])
    records = read_trace(path, format="mooncake")
    assert records.sessions is not None
    assert records.sessions.parent.tolist() == [-1, 0, -1, -1, 1, -1, -1, -1]
    s = _sessions(path, "mooncake")
    assert (s.source, s.sessions, s.turns.max) == ("hash_ids", 6, 3)
    assert s.think_time_s is not None and s.think_time_s.quantiles[::100] == [10, 20]
    assert s.context_growth is not None and s.context_growth.quantiles[::100] == [500, 500]


def test_mooncake_trace_has_sane_sessions(mooncake_path: Path) -> None:
    s = _sessions(mooncake_path, "mooncake")
    assert s.sessions > 0 and s.turns.min >= 1 and s.turns.max >= 2
    assert 0 < s.multi_turn_fraction < 1 and s.think_time_basis == "arrival"
    assert s.think_time_s is not None and s.think_time_s.p50 > 0
    assert s.context_growth is not None and s.context_growth.mean > 0


def test_a_trace_without_links_has_no_sessions(azure_path: Path) -> None:
    assert fit_shape(read_trace(azure_path)).sessions is None


def test_old_shapes_keep_their_fingerprint(tmp_path: Path, multi_turn: Path) -> None:
    """A shape without the sessions section: the fingerprint of its statistics is what it
    was before the section existed, and it loads unchanged."""
    old = load_shape(REPO / "traffic" / "azure-conv.json")
    assert old.sessions is None
    dump = old.model_dump()
    del dump["sessions"]
    assert compute_fingerprint(dump) == old.fingerprint
    new = fit_shape(read_trace(multi_turn))
    path = save_shape(new, tmp_path / "s.json")
    again = load_shape(path)
    assert again.sessions == new.sessions and again.fingerprint == new.fingerprint
    changed = new.model_copy(update={"sessions": None}).model_dump()
    assert compute_fingerprint(changed) != new.fingerprint  # the section is fingerprinted


def test_a_subset_of_turns_restarts_sessions(multi_turn: Path) -> None:
    links = read_trace(multi_turn).sessions
    assert links is not None
    # arrival order: chat 1, 10, 2, 3, 4, 6
    assert links.parent.tolist() == [-1, -1, 0, 0, 2, 4]
    part = links.take(np.array([0, 1, 3, 4, 5]))  # without chat 2: chat 4 starts a session
    assert part.parent.tolist() == [-1, -1, 0, -1, 3]
    root, turn = part.tree()
    assert root.tolist() == [0, 1, 0, 3, 3] and turn.tolist() == [1, 1, 2, 1, 2]


def test_show_and_diff_cover_sessions(
    tmp_path: Path, multi_turn: Path, openai_log: Path, azure_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    for trace, out in ((multi_turn, a), (openai_log, b), (azure_path, c)):
        rc, _, err = _run(capsys, "shape", "fit", str(trace), "-o", str(out))
        assert rc == 0, err
    rc, out, _ = _run(capsys, "shape", "show", str(a))
    assert rc == 0 and "sessions      2 " in out and "(parent_id)" in out
    assert "think time    p50 5.5 s, mean 5.25 s, p90 6 s" in out and "between arrivals" in out
    assert "fan-out 33.3% (max 2)" in out and "context growth per turn" in out
    rc, out, _ = _run(capsys, "shape", "show", str(b), "--json")
    summary = json.loads(out)
    assert summary["sessions"]["sessions"] == 3
    assert summary["sessions"]["in_flight_fraction"] == pytest.approx(1 / 3, abs=1e-5)
    rc, out, _ = _run(capsys, "shape", "diff", str(a), str(b), "--json")
    d = json.loads(out)["dimensions"]
    assert d["session_turns"]["distance"] is not None and d["think_time"]["distance"] > 0
    rc, out, _ = _run(capsys, "shape", "diff", str(a), str(b))
    assert "session_turns" in out and "think times are measured differently" in out
    rc, out, _ = _run(capsys, "shape", "diff", str(c), str(a))
    assert "only chats has sessions" in out and "think_time" in out
    ad = diff_shapes(load_shape(c), load_shape(c))
    assert ad.dimensions["session_turns"].distance is None and ad.verdict == "same"


@pytest.mark.parametrize(
    ("rows", "what"),
    [
        ([_turn(1, -1, 0.0, 10, 2), _turn(2, 99, 1.0, 10, 2)],
         "line 2: 'parent_chat_id' is 99, but no turn has that chat_id"),
        ([_turn(1, 2, 0.0, 10, 2), _turn(2, 1, 0.0, 10, 2)],
         "the parent links form a cycle (chat_id 1 -> 2 -> 1"),
        ([_turn("x", "x", 0.0, 10, 2)], "form a cycle (chat_id 'x' -> 'x'"),
        ([_turn(1, -1, 5.0, 10, 2), _turn(2, 1, 3.0, 10, 2)],
         "line 2: turn 2 arrives at 3 s, before its parent 1 (line 1) at 5 s, a negative "
         "think time"),
        ([_turn(1, -1, 0.0, 10, 2), _turn(1, -1, 1.0, 10, 2)],
         "line 2: 'chat_id' 1 is already the id of line 1"),
        ([_turn(True, -1, 0.0, 10, 2)], "'chat_id' is True; expected an integer or string id"),
    ],
)
def test_bad_session_data_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: list[dict[str, object]],
    what: str,
) -> None:
    trace = _jsonl(tmp_path / "bad.jsonl", rows)
    out_path = tmp_path / "o.json"
    rc, _, err = _run(capsys, "shape", "fit", str(trace), "-o", str(out_path))
    assert rc == 2 and not out_path.exists(), err
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"autotune: error: traffic file {trace}") and what in line


def test_skip_bad_starts_a_session_at_a_missing_parent(tmp_path: Path) -> None:
    trace = _jsonl(tmp_path / "t.jsonl", [_turn(1, -1, 0.0, 10, 2), _turn(2, 99, 1.0, 10, 2)])
    with pytest.raises(TraceFormatError):
        read_trace(trace)
    records = read_trace(trace, skip_bad=True)
    links = records.sessions
    assert links is not None and links.parent.tolist() == [-1, -1]
    assert records.links_cut == (2,)  # the line of the turn whose parent is missing


def test_shape_fit_skip_bad_says_how_many_session_links_it_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # issue 66: `shape fit --skip-bad` re-rooted a turn whose parent was missing silently
    trace = _jsonl(tmp_path / "t.jsonl", [_turn(1, -1, 0.0, 10, 2), _turn(2, 99, 1.0, 10, 2),
                                          _turn(3, 98, 2.0, 10, 2)])
    rc, _, err = _run(capsys, "shape", "fit", str(trace), "--skip-bad", "-o",
                      str(tmp_path / "o.json"))
    assert rc == 0, err
    assert "cut 2 session link(s): a turn whose parent_chat_id no turn has starts a session " \
           "of its own (--skip-bad); line(s) 2, 3" in err


def test_clip_scales_the_session_prompts(multi_turn: Path, tmp_path: Path) -> None:
    shape = fit_shape(read_trace(multi_turn))
    half = clip_shape(shape, scale_input=0.5, max_input_tokens=70)
    s, h = shape.sessions, half.sessions
    assert s is not None and h is not None and s.new_tokens is not None
    assert h.new_tokens is not None and h.context_growth is not None
    assert h.first_turn_tokens.max == 50 and h.first_turn_tokens.min == 30
    assert (h.new_tokens.min, h.new_tokens.max) == (s.new_tokens.min / 2, s.new_tokens.max / 2)
    # turn 2's mean prompt: half its prompt tokens, its parent's answer at full length
    out = shape.output_tokens.mean
    assert h.context_by_turn[1] == pytest.approx(s.context_by_turn[1] / 2 + out / 2, abs=0.1)
    assert h.context_by_turn[0] == 40 and h.context_by_turn[2:] == [70, 70]  # capped
    assert h.turns == s.turns and h.think_time_s == s.think_time_s
    assert half.fingerprint != shape.fingerprint
    assert load_shape(save_shape(half, tmp_path / "half.json")).sessions == h


def test_clip_moves_the_answers_in_context_growth_to_the_clipped_outputs() -> None:
    """A turn's context grows by its new tokens and its parent's answer: --scale-input
    scales the first, the answer takes the clipped output length (not the input scale)."""
    from autotune.traffic import LoadSpec, SessionStats, constant_shape, length_dist

    base = constant_shape(320, 20, load=LoadSpec(mode="open", rate_rps=3.0, requests=30))
    sessions = SessionStats(
        source="session_id", sessions=10, rate_sps=1.0, multi_turn_fraction=1.0,
        turns=length_dist([3]), first_turn_tokens=length_dist([320]),
        new_tokens=length_dist([64]), context_growth=length_dist([84]),
        context_by_turn=[320.0, 404.0, 488.0])
    shape = base.model_copy(update={"sessions": sessions})

    def clipped(**kw: float) -> SessionStats:
        out = clip_shape(shape, **kw).sessions  # type: ignore[arg-type]
        assert out is not None
        return out

    q = clipped(scale_input=0.25)  # new tokens 16, answers still 20
    assert q.new_tokens is not None and q.new_tokens.p50 == 16
    assert q.context_growth is not None and q.context_growth.p50 == 36
    assert q.context_by_turn == [80, 116, 152]
    both = clipped(scale_input=0.25, scale_output=0.5)  # answers of 10
    assert both.context_growth is not None and both.context_growth.mean == 26
    assert both.context_by_turn == [80, 106, 132]
    assert clipped(scale_input=0.25, max_input_tokens=100).context_by_turn == [80, 100, 100]
    same = clipped(scale_lengths=0.5)  # prompts and answers alike: growth scales as before
    assert same.context_growth is not None and same.context_growth.p50 == 42
    assert same.context_by_turn == [160, 202, 244]


def _prefixed(source: str, *, share: float, ratio: float, prompt: int, block: int | None,
              sessions: SessionStats | None = None) -> TrafficShape:
    """A constant shape of ``prompt``-token prompts whose prefix section says ``share`` of
    prompt tokens are cacheable, every sharing request's head ``ratio`` of its prompt."""
    from autotune.traffic import LoadSpec, PrefixStats, constant_shape, length_dist

    base = constant_shape(prompt, 20, load=LoadSpec(mode="open", rate_rps=3.0, requests=30))
    prefix = PrefixStats(source=source, block_tokens=block,  # type: ignore[arg-type]
                         shared_token_fraction=share, sharing_request_fraction=1.0,
                         groups=1, mean_group_size=30.0,
                         shared_prefix_tokens=length_dist([prompt * ratio]),
                         shared_prefix_ratio=[ratio] * 101)
    return base.model_copy(update={"prefix": prefix, "sessions": sessions})


def test_clip_scales_the_hash_block_with_the_prompts() -> None:
    """A 512-token hash block at --scale-input 1/32 is 16 tokens; without a cap the
    cacheable share stays; scaling only the outputs keeps the block."""
    shape = _prefixed("hash_ids", share=0.3, ratio=0.5, prompt=1024, block=512)
    small = clip_shape(shape, scale_input=1 / 32).prefix
    assert small is not None and small.block_tokens == 16
    assert small.shared_token_fraction == pytest.approx(0.3)
    assert small.shared_prefix_tokens is not None and small.shared_prefix_tokens.p50 == 16
    outs = clip_shape(shape, scale_output=0.5).prefix
    assert outs is not None and outs.block_tokens == 512
    assert outs.shared_token_fraction == pytest.approx(0.3)
    odd = clip_shape(_prefixed("hash_ids", share=0.3, ratio=0.5, prompt=64, block=16),
                     scale_input=1 / 64).prefix
    assert odd is not None and odd.block_tokens == 1  # never below one token


def test_clip_recomputes_the_cacheable_share_for_capped_prompts() -> None:
    """A cap cuts a prompt's tail before its shared head: prompts of 1,000 tokens, half of
    them shared, capped at 400, are all head (the share doubles); a 200-token head of a
    prompt capped at 400 is half of it (the share x 2.5)."""
    half = clip_shape(_prefixed("prefix_id", share=0.3, ratio=0.5, prompt=1000, block=None),
                      max_input_tokens=400).prefix
    assert half is not None and half.shared_token_fraction == pytest.approx(0.6, abs=0.01)
    assert half.shared_prefix_tokens is not None and half.shared_prefix_tokens.p50 == 400
    fifth = clip_shape(_prefixed("prefix_id", share=0.2, ratio=0.2, prompt=1000, block=None),
                       max_input_tokens=400).prefix
    assert fifth is not None and fifth.shared_token_fraction == pytest.approx(0.5, abs=0.01)
    full = clip_shape(_prefixed("prefix_id", share=0.9, ratio=0.9, prompt=1000, block=None),
                      max_input_tokens=100).prefix
    assert full is not None and full.shared_token_fraction <= 1.0


def test_clip_recomputes_the_share_within_sessions() -> None:
    """Within sessions a later turn finds its parent's prompt and answer cached: with the
    prompts at 1/4 and the answers kept (20 tokens), the answers weigh more and the share
    rises from (340 + 424) / 1212 to (100 + 136) / 348."""
    from autotune.traffic import length_dist

    sessions = SessionStats(
        source="session_id", sessions=10, rate_sps=1.0, multi_turn_fraction=1.0,
        turns=length_dist([3]), first_turn_tokens=length_dist([320]),
        new_tokens=length_dist([64]), context_growth=length_dist([84]),
        context_by_turn=[320.0, 404.0, 488.0])
    shape = _prefixed("session", share=764 / 1212, ratio=0.6, prompt=404, block=None,
                      sessions=sessions)
    p = clip_shape(shape, scale_input=0.25).prefix
    assert p is not None and p.shared_token_fraction == pytest.approx(236 / 348, abs=1e-4)
    same = clip_shape(shape, scale_lengths=0.5).prefix  # answers scale too: share stays
    assert same is not None
    assert same.shared_token_fraction == pytest.approx(764 / 1212, abs=1e-4)
