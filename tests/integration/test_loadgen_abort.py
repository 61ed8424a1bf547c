"""A replay that is mostly failing stops early and says why (loadgen abort hook)."""

from __future__ import annotations

import time

from autotune.engine import free_port
from autotune.load import failure_abort, replay
from autotune.testing.stub_server import StubConfig, StubServer, fault_token
from autotune.traffic import RequestSpec, Schedule


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
