"""The load generator against a real local stub server that streams, and misbehaves on purpose."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from autotune.errors import LoadgenError
from autotune.load import ERROR_REASONS, RunResult, replay, run_schedule
from autotune.measure import measure, snapshot_metrics
from autotune.testing.stub_server import FAULTS, StubConfig, StubServer, fault_token
from autotune.traffic import RequestSpec, Schedule
from tests._loadgen import PROMPT, closed


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer(StubConfig(chunk_interval_s=0.002, stall_s=5.0)) as s:
        yield s


@pytest.fixture(scope="module")
def spec_stub() -> Iterator[StubServer]:
    """Three tokens per SSE chunk, as speculative decoding streams them."""
    with StubServer(StubConfig(tokens_per_chunk=3, chunk_interval_s=0.002)) as s:
        yield s


def check_ok(run: RunResult, max_tokens: int, prompt_len: int) -> None:
    for r in run.records:
        assert r.ok, (r.error, r.detail)
        assert r.error is None and r.status == 200
        assert r.output_tokens == max_tokens == sum(r.chunk_tokens)
        assert r.prompt_tokens == prompt_len
        assert len(r.chunk_times_s) == len(r.chunk_tokens) > 0
        assert r.first_token_s == r.chunk_times_s[0]
        assert r.send_s <= r.first_token_s <= r.chunk_times_s[-1] <= r.end_s <= run.wall_s
        assert list(r.chunk_times_s) == sorted(r.chunk_times_s)


def test_closed_loop_records_every_request_in_schedule_order(stub: StubServer) -> None:
    run = replay(closed(40, conc=8), base_url=stub.base_url, model="tiny")
    assert [r.index for r in run.records] == list(range(40))
    assert run.mode == "closed" and run.concurrency == 8 and run.wall_s > 0
    check_ok(run, 12, len(PROMPT))
    # never more than 8 in flight
    events = sorted([(r.send_s, 1) for r in run.records] + [(r.end_s, -1) for r in run.records])
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    assert peak == 8


def test_chat_api_counts_tokens_not_the_role_chunk(stub: StubServer) -> None:
    run = replay(closed(6, conc=3), base_url=stub.base_url, model="tiny", api="chat")
    check_ok(run, 12, len(PROMPT))
    assert all(r.chunk_tokens[0] == 1 for r in run.records)


def test_several_tokens_per_chunk_are_counted_from_usage(spec_stub: StubServer) -> None:
    run = replay(closed(4, conc=2, max_tokens=10), base_url=spec_stub.base_url, model="tiny")
    check_ok(run, 10, len(PROMPT))
    assert run.records[0].chunk_tokens == (3, 3, 3, 1)


def test_without_usage_it_counts_one_token_per_chunk(stub: StubServer) -> None:
    prompt = (fault_token("no_usage"), 1, 2)
    run = replay(closed(2, conc=2, prompt=prompt), base_url=stub.base_url, model="tiny")
    for r in run.records:
        assert r.ok and r.prompt_tokens is None
        assert r.output_tokens == len(r.chunk_tokens) == 12


def test_open_loop_sends_on_schedule() -> None:
    offsets = [0.0, 0.05, 0.1, 0.2, 0.3]
    reqs = tuple(RequestSpec(i, PROMPT, 4, send_at_s=t) for i, t in enumerate(offsets))
    with StubServer(StubConfig(ttft_s=0.01)) as s:
        run = replay(Schedule(mode="open", requests=reqs), base_url=s.base_url, model="tiny")
    assert run.mode == "open"
    for r, t in zip(run.records, offsets, strict=True):
        assert r.ok
        assert t - 0.002 <= r.send_s <= t + 0.25  # never early; late only by scheduling


def test_open_loop_concurrency_cap_holds_back_sends() -> None:
    reqs = tuple(RequestSpec(i, PROMPT, 4, send_at_s=0.0) for i in range(6))
    with StubServer(StubConfig(ttft_s=0.1)) as s:
        run = replay(
            Schedule(mode="open", requests=reqs, concurrency=2), base_url=s.base_url, model="tiny"
        )
    assert all(r.ok for r in run.records)
    sends = sorted(r.send_s for r in run.records)
    assert sends[2] >= 0.09  # the third waited for one of the first two to finish


# --- bad conditions: each against a stub that misbehaves for real ------------------------

EXPECTED = {
    "ok": None,
    "http_400": "http_4xx",
    "http_500": "http_5xx",
    "disconnect": "disconnected",
    "stall": "stalled",
    "slow": "timeout",
    "malformed": "malformed_sse",
    "garbage": "malformed_sse",
    "error_event": "server_error",
    "no_done": "disconnected",
    "no_usage": None,
}


@pytest.fixture(scope="module")
def faulty_run(stub: StubServer) -> RunResult:
    """Every fault twice, shuffled among good requests, in one closed-loop run."""
    faults = [f for f in FAULTS for _ in range(2)] + ["ok"] * 10
    reqs = tuple(
        RequestSpec(i, (fault_token(f), 1, 2, 3), 60 if f == "slow" else 12)
        for i, f in enumerate(faults)
    )
    return replay(
        Schedule(mode="closed", requests=reqs, concurrency=8),
        base_url=stub.base_url,
        model="tiny",
        request_timeout_s=1.0,
        stall_timeout_s=0.3,
    )


@pytest.mark.parametrize("fault", list(EXPECTED))
def test_each_fault_is_a_record_with_its_reason(faulty_run: RunResult, fault: str) -> None:
    faults = [f for f in FAULTS for _ in range(2)] + ["ok"] * 10
    recs = [r for r, f in zip(faulty_run.records, faults, strict=True) if f == fault]
    assert recs
    for r in recs:
        assert r.error == EXPECTED[fault], (fault, r.error, r.detail)
        assert r.ok is (EXPECTED[fault] is None)
        if not r.ok:
            assert r.error in ERROR_REASONS and r.detail and r.end_s is not None
    if fault in ("http_400", "http_500"):
        assert all(
            r.status == int(fault[-3:]) and "fault requested" in (r.detail or "") for r in recs
        )
    if fault in ("disconnect", "stall", "malformed", "error_event"):
        assert all(
            r.chunk_tokens and r.first_token_s is not None for r in recs
        )  # partial data kept
    if fault == "stall":
        assert all(0.1 <= r.end_s - r.chunk_times_s[-1] < 2.0 for r in recs)
    if fault == "slow":
        assert all(0.95 <= r.end_s - r.send_s < 3.0 for r in recs)


def test_measurement_completes_and_counts_failures(faulty_run: RunResult) -> None:
    m = measure(faulty_run)
    n_bad = sum(1 for f in EXPECTED.values() if f is not None) * 2
    assert m.n_requests == len(faulty_run.records) and m.n_errors == n_bad
    assert m.error_rate == pytest.approx(n_bad / m.n_requests)
    assert m.errors == {
        "http_4xx": 2,
        "http_5xx": 2,
        "disconnected": 4,
        "stalled": 2,
        "timeout": 2,
        "malformed_sse": 4,
        "server_error": 2,
    }
    assert m.output_tokens_per_s is not None and m.output_tokens_per_s > 0


def test_connection_refused_is_data() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        run = replay(closed(3, conc=2), base_url=f"http://127.0.0.1:{port}", model="tiny")
    assert [r.error for r in run.records] == ["connection_refused"] * 3
    m = measure(run)
    assert (
        m.error_rate == 1.0
        and m.output_tokens_per_s is None
        and m.errors == {"connection_refused": 3}
    )


# --- API edges ------------------------------------------------------------------------------


def test_replay_works_from_a_thread(stub: StubServer) -> None:
    out: list[RunResult] = []
    t = threading.Thread(
        target=lambda: out.append(replay(closed(3, conc=3), base_url=stub.base_url, model="tiny"))
    )
    t.start()
    t.join(20)
    assert out and all(r.ok for r in out[0].records)


def test_replay_inside_a_running_loop_says_to_await(stub: StubServer) -> None:
    async def inside() -> None:
        replay(closed(1, conc=1), base_url=stub.base_url, model="tiny")

    with pytest.raises(LoadgenError, match="await run_schedule"):
        asyncio.run(inside())


def test_run_schedule_awaitable_with_progress(stub: StubServer) -> None:
    seen: list[tuple[int, int]] = []
    run = asyncio.run(
        run_schedule(
            closed(5, conc=2),
            base_url=stub.base_url + "/",
            model="tiny",
            progress=lambda d, t: seen.append((d, t)),
        )
    )
    assert len(run.records) == 5
    assert seen == [(i, 5) for i in range(1, 6)]


def test_metrics_sampled_during_the_run_give_server_figures(stub: StubServer) -> None:
    before = snapshot_metrics(stub.base_url)
    run = replay(closed(30, conc=6), base_url=stub.base_url, model="tiny", metrics_interval_s=0.02)
    after = snapshot_metrics(stub.base_url)
    assert len(run.snapshots) >= 3
    m = measure(run)
    assert m.server["generation_tokens_per_s"] > 0 and "requests_running" in m.server
    whole = measure(run, server_before=before, server_after=after)
    assert whole.server["generation_tokens"] == sum(r.output_tokens for r in run.records)
    assert whole.server["requests_success"] == 30


# --- the SSE parser on its own ---------------------------------------------------------------


def test_metrics_failures_are_clear_and_never_stop_a_run(stub: StubServer) -> None:
    from autotune.measure import scrape_metrics

    with pytest.raises(LoadgenError, match="answered HTTP 404"):
        asyncio.run(scrape_metrics(stub.base_url + "/v1"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(LoadgenError, match="/metrics failed"):
            snapshot_metrics(url)
        run = replay(closed(2, conc=2), base_url=url, model="tiny", metrics_interval_s=0.01)
    assert run.snapshots == () and len(run.records) == 2

    async def inside() -> None:
        snapshot_metrics(url)

    with pytest.raises(LoadgenError, match="await scrape_metrics"):
        asyncio.run(inside())


# --- segments, refills and staggered streams (issue 14) ---------------------------------


class _StopAfter:
    """A SegmentControl that stops the sends after ``n`` segments and keeps what it saw."""

    def __init__(self, every: int, n: int) -> None:
        self.segment_requests = every
        self.n = n
        self.seen: list[tuple[float, int]] = []

    def on_segment(self, t_s: float, tokens: int, failed: int) -> bool:
        assert failed == 0
        self.seen.append((t_s, tokens))
        return len(self.seen) >= self.n


def test_control_cuts_segments_refills_and_stops_the_sends(stub: StubServer) -> None:
    from dataclasses import replace

    ctl = _StopAfter(every=8, n=5)
    asked: list[int] = []

    def refill(next_index: int) -> list[RequestSpec]:
        asked.append(next_index)
        return [replace(r, index=next_index + i) for i, r in enumerate(closed(8, conc=4).requests)]

    run = replay(closed(8, conc=4), base_url=stub.base_url, model="tiny", control=ctl,
                 refill=refill)
    assert len(ctl.seen) == 5 and run.stopped_at_s == ctl.seen[-1][0]
    times = [t for t, _ in ctl.seen]
    tokens = [k for _, k in ctl.seen]
    assert times == sorted(times) and tokens == sorted(tokens) and tokens[0] > 0
    assert asked and asked[0] == 8  # the schedule's 8, then refills numbered on from 8
    # the sends stopped at the last segment: what was in flight finished, nothing after
    n = len(run.records)
    assert 5 * 8 <= n <= 5 * 8 + 4
    assert [r.index for r in run.records] == list(range(n))
    assert all(r.ok for r in run.records)
    assert max(r.send_s for r in run.records) <= run.stopped_at_s
    # tokens seen at a segment end are at most what had arrived by then
    got = sum(k for r in run.records for t, k in zip(r.chunk_times_s, r.chunk_tokens,
                                                    strict=True) if t <= times[-1])
    assert tokens[-1] <= got + 12 * 4


def test_a_refill_that_runs_dry_ends_the_run(stub: StubServer) -> None:
    ctl = _StopAfter(every=4, n=1000)
    run = replay(closed(6, conc=2), base_url=stub.base_url, model="tiny", control=ctl,
                 refill=lambda i: [])
    assert len(run.records) == 6 and run.stopped_at_s is None


def test_stagger_shortens_only_each_streams_first_request(stub: StubServer) -> None:
    from autotune.load import staggered

    first = list(closed(4, conc=4, max_tokens=40).requests)
    assert [s.max_tokens for s in staggered(first, 4)] == [10, 20, 30, 40]
    run = replay(closed(12, conc=4, max_tokens=40), base_url=stub.base_url, model="tiny",
                 stagger=True)
    assert [r.output_tokens for r in run.records] == [10, 20, 30, 40] + [40] * 8
    with pytest.raises(LoadgenError, match="closed-loop"):
        replay(Schedule(mode="open", requests=(RequestSpec(0, PROMPT, 4, 0.0),)),
               base_url=stub.base_url, model="tiny", stagger=True)


def test_an_interrupt_ends_the_run_at_once_and_says_what_is_complete(stub: StubServer) -> None:
    """``interrupt`` (bench's SIGTERM) cancels the requests in flight instead of waiting a
    whole request's duration for them; the run says up to when its records hold every
    token that arrived (the earliest send among the cancelled)."""
    from dataclasses import replace

    event = threading.Event()
    sched = closed(4, conc=4, max_tokens=400)  # 0.8 s a request

    def refill(next_index: int) -> list[RequestSpec]:
        return [replace(r, index=next_index + i) for i, r in enumerate(sched.requests)]

    timer = threading.Timer(1.3, event.set)
    timer.start()
    try:
        run = replay(sched, base_url=stub.base_url, model="tiny", refill=refill,
                     interrupt=event)
    finally:
        timer.cancel()
    assert run.interrupted_at_s is not None and 1.25 <= run.interrupted_at_s < 1.8
    assert run.wall_s < run.interrupted_at_s + 0.5  # no wait for the 0.8-s requests
    assert run.stopped_at_s == run.interrupted_at_s
    # the four requests that finished first were recorded whole; those in flight were not
    done = list(run.records)
    assert len(done) >= 4 and all(r.ok and r.output_tokens == 400 for r in done)
    assert all(r.end_s is not None and r.end_s <= run.interrupted_at_s for r in done)
    cut = run.complete_before_s
    assert cut is not None and 0.7 <= cut <= run.interrupted_at_s  # the second wave's send
    # a run nobody interrupted says so
    calm = replay(closed(2, conc=2), base_url=stub.base_url, model="tiny",
                  interrupt=threading.Event())
    assert calm.interrupted_at_s is None and calm.complete_before_s is None
    assert len(calm.records) == 2
