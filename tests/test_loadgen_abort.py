"""A replay that is mostly failing stops early and says why (loadgen abort hook)."""

from __future__ import annotations

import time

from autotune.testing.stub_server import StubConfig, StubServer, fault_token

from autotune.engine import free_port
from autotune.load import RequestRecord, failure_abort, replay
from autotune.traffic import RequestSpec, Schedule


def _rec(error: str | None, detail: str | None = None) -> RequestRecord:
    return RequestRecord(index=0, send_s=0.0, first_token_s=None, end_s=1.0, chunk_times_s=(),
                         chunk_tokens=(), prompt_tokens=None, output_tokens=0,
                         ok=error is None, error=error, detail=detail, status=None)


def test_abort_waits_for_the_minimum_then_names_the_cause() -> None:
    check = failure_abort(min_requests=4, max_failed_fraction=0.5)
    assert check(_rec("timeout"), 1, 1) is None  # too few to judge
    assert check(_rec(None), 2, 1) is None
    assert check(_rec("stalled"), 3, 2) is None
    line = check(_rec("stalled"), 4, 3)
    assert line is not None and "3 of 4" in line and "--rate-scale" in line
    assert "\n" not in line
    ctx = failure_abort(min_requests=2)
    detail = "This model's maximum context length is 1024 tokens"
    ctx(_rec("http_4xx", detail), 1, 1)
    line = ctx(_rec("http_4xx", detail), 2, 2)
    assert line is not None and "context" in line and "--max-total-tokens" in line


def test_open_loop_replay_stops_early_against_a_failing_server() -> None:
    bad = (fault_token("http_500"),) * 8
    reqs = tuple(RequestSpec(i, bad, 4, send_at_s=0.02 * i) for i in range(400))
    with StubServer(StubConfig(ttft_s=0.001)) as s:
        t0 = time.monotonic()
        run = replay(Schedule(mode="open", requests=reqs), base_url=s.base_url, model="m",
                     abort=failure_abort(min_requests=20))
        took = time.monotonic() - t0
    assert run.aborted is not None
    assert "http_5xx" in run.aborted and "fails the requests" in run.aborted
    assert 20 <= len(run.records) < 100 and took < 4.0  # the whole schedule is 8 s


def test_closed_loop_replay_stops_when_nothing_listens() -> None:
    reqs = tuple(RequestSpec(i, (10, 11), 4) for i in range(200))
    run = replay(Schedule(mode="closed", requests=reqs, concurrency=4),
                 base_url=f"http://127.0.0.1:{free_port()}", model="m",
                 abort=failure_abort(min_requests=20))
    assert run.aborted is not None and "stopped answering" in run.aborted
    assert len(run.records) < 200
