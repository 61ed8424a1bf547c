"""``autotune rollout`` end to end (slow): a real ``vllm-router`` (scripts/setup-router.sh) in
front of real CPU vLLM servers of the tiny model, live traffic from autotune's own load
generator through the router. One router and at most two servers at a time: the session's
shared tiny server is the old one; each test starts one new server.

(a) the same config: promoted, the old server out of the router and idle, zero failed
requests; (b) ``--max-num-seqs 1`` started with ``--start`` from a best.json: rolled back at
the first step and stopped, zero failed requests; (c) the new server SIGKILLed mid-rollout:
rolled back, the requests it held reported, no request retried by the client.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autotune.load import _http
from autotune.cli import main
from autotune.engine import VllmServer, free_port
from autotune.load import RunResult, replay
from autotune.rollout import RouterClient, RouterError
from autotune.traffic import RequestSpec, Schedule

pytestmark = pytest.mark.slow

ROUTER_BIN = Path(sys.executable).parent / "vllm-router"
FLAGS = ["--max-model-len", "1024", "-O0"]  # the shared tiny server's own flags
# Short windows and a generous tolerance: the decisions are about a config that is the
# same (a) or several times slower (b), on two shared cores, in under a minute a step.
JUDGE = ["--metrics", "ttft_p50,tpot_p50,e2e_p50", "--tolerance", "1.0",
         "--error-tolerance", "0.2", "--min-requests", "15", "--interval", "2s",
         "--min-hold", "6s", "--step-timeout", "150s", "--drain-timeout", "120s"]


@pytest.fixture
def router(tiny_server: Any, tmp_path: Path) -> Iterator[str]:
    """A fresh vllm-router holding only the shared tiny server (round robin)."""
    if not ROUTER_BIN.exists():
        pytest.skip("vllm-router is not installed: run scripts/setup-router.sh")
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [str(ROUTER_BIN), "--worker-urls", tiny_server.base_url, "--host", "127.0.0.1",
         "--port", str(port), "--policy", "round_robin", "--prometheus-port",
         str(free_port()), "--prometheus-host", "127.0.0.1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(RouterError):
                if RouterClient(url, timeout_s=2).list_workers() == [tiny_server.base_url]:
                    break
            assert proc.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the router did not come up in 60 s"
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()


class Traffic:
    """Closed-loop live traffic through the router until stopped: ``streams`` streams (4),
    short requests; every record kept (the load generator's own)."""

    def __init__(self, url: str, model: str, streams: int = 4) -> None:
        self.stop = threading.Event()
        self.result: RunResult | None = None
        rng = random.Random(7)

        def more(start: int) -> list[RequestSpec]:
            return [RequestSpec(i, tuple(rng.randrange(10, 4000) for _ in range(24)), 12)
                    for i in range(start, start + 32)]

        class Until:
            segment_requests = 1

            def on_segment(_self, t_s: float, tokens: int, failed: int) -> bool:
                return self.stop.is_set()

        sched = Schedule(mode="closed", requests=tuple(more(0)), concurrency=streams)
        self.thread = threading.Thread(target=self._run, args=(sched, url, model, more, Until()))
        self.thread.start()

    def _run(self, sched: Schedule, url: str, model: str, more: Any, until: Any) -> None:
        self.result = replay(sched, base_url=url, model=model, control=until, refill=more,
                             request_timeout_s=120, stall_timeout_s=60)

    def finish(self) -> RunResult:
        self.stop.set()
        self.thread.join(180)
        assert self.result is not None
        return self.result


def _new_server(tiny_llama: Path, tmp_path: Path, flags: list[str]) -> VllmServer:
    s = VllmServer(model=str(tiny_llama), flags=flags, log_path=tmp_path / "new.log",
                   served_model_name="autotune-model",
                   start_timeout_s=float(os.environ.get("AUTOTUNE_TEST_START_TIMEOUT", "400")))
    s.start()
    s.wait_healthy()
    return s


def _failed(run: RunResult) -> list[Any]:
    return [r for r in run.records if not r.ok]


def _events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]


def test_same_config_is_promoted_and_the_old_server_drained(
        router: str, tiny_server: Any, tiny_llama: Path, tmp_path: Path, capsys: Any) -> None:
    new = _new_server(tiny_llama, tmp_path, FLAGS)
    out = tmp_path / "rollout"
    assert main(["rollout", "--router", router, "--new", new.base_url, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert f"step 1 (1): new {new.base_url} | old {tiny_server.base_url}" in plan
    assert "step 2 (100%)" in plan and "the switch" in plan
    assert RouterClient(router).list_workers() == [tiny_server.base_url]  # nothing changed
    traffic = Traffic(router, tiny_server.model_name)
    try:
        rc = main(["rollout", "--router", router, "--new", new.base_url, *JUDGE,
                   "--out", str(out), "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"])
        time.sleep(2)  # traffic keeps flowing through the promoted server alone
        run = traffic.finish()
    finally:
        traffic.stop.set()
        new.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0, summary
    assert summary["outcome"] == "promoted" and summary["mlflow_run_id"]
    assert [s["decision"] for s in summary["steps"] if not s.get("final")] == ["pass"]
    assert not _failed(run), _failed(run)[:3]
    assert len(run.records) >= 30
    kinds = [e["event"] for e in _events(out)]
    assert kinds.index("promoted") < kinds.index("drained")
    drained = next(e for e in _events(out) if e["event"] == "drained")
    assert drained["url"] == tiny_server.base_url and drained["idle"]
    # the old server is out of the router and runs nothing (it stays up: not ours to stop)
    assert RouterClient(router).list_workers() == [new.base_url]
    metrics = _http.get(tiny_server.base_url + "/metrics").text
    assert 'vllm:num_requests_running{' in metrics
    for line in metrics.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            assert float(line.rsplit(None, 1)[1]) == 0.0


def test_worse_config_rolls_back_at_the_first_step(
        router: str, tiny_server: Any, tiny_llama: Path, tmp_path: Path) -> None:
    best = tmp_path / "best.json"
    best.write_text(json.dumps({"flags": [*FLAGS, "--max-num-seqs", "1"],
                                "model": str(tiny_llama), "study": "rollout-test",
                                "env": {}, "trial": 0,
                                "objective": {"name": "throughput",
                                              "metric": "output_tokens_per_s", "value": 1.0}}))
    out = tmp_path / "rollout"
    # 8 streams: the router's share of them at the first step must queue behind one sequence
    # at a time; with 4, the new server often held one request at once, served it as fast
    # as the old one, and was promoted
    traffic = Traffic(router, tiny_server.model_name, streams=8)
    try:
        rc = main(["rollout", "--router", router, "--start", "--best", str(best), *JUDGE,
                   "--out", str(out), "--no-mlflow"])
        run = traffic.finish()
    finally:
        traffic.stop.set()
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 1, summary
    assert summary["outcome"] == "rolled_back"
    assert summary["why"].startswith("step 1:") and "worse beyond the tolerance" in summary["why"]
    assert len(summary["steps"]) == 1 and summary["steps"][0]["decision"] == "regress"
    assert not _failed(run), _failed(run)[:3]
    assert RouterClient(router).list_workers() == [tiny_server.base_url]
    stopped = [e for e in _events(out) if e["event"] == "stopped"]
    assert stopped and stopped[0]["by"] == "autotune"


def test_new_server_killed_mid_rollout_rolls_back(
        router: str, tiny_server: Any, tiny_llama: Path, tmp_path: Path) -> None:
    new = _new_server(tiny_llama, tmp_path, FLAGS)
    out = tmp_path / "rollout"
    held_at_kill: list[int] = []
    killed_at: list[float] = []

    def killer() -> None:  # SIGKILL the new server once it serves the router's traffic
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            log = out / "rollout.jsonl"
            if log.exists() and any(e["event"] == "compare" and e["new"]["finished"] >= 5
                                    for e in _events(out)):
                from autotune.rollout._run import scrape

                snap = scrape(new.base_url)
                held_at_kill.append(int(snap.running + snap.waiting) if snap else 0)
                os.killpg(new.pid, signal.SIGKILL)  # type: ignore[arg-type]
                killed_at.append(time.time())
                return
            time.sleep(0.2)

    k = threading.Thread(target=killer)
    traffic = Traffic(router, tiny_server.model_name)
    k.start()
    try:
        rc = main(["rollout", "--router", router, "--new", new.base_url, *JUDGE,
                   "--step-timeout", "300s", "--out", str(out), "--no-mlflow"])
        run = traffic.finish()
    finally:
        traffic.stop.set()
        k.join(60)
        new.stop()
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 1, summary
    assert summary["outcome"] == "rolled_back" and "died" in summary["why"], summary["why"]
    assert held_at_kill, "the new server was never killed"
    assert isinstance(summary["lost_requests"], int) and summary["lost_requests"] >= 0
    assert RouterClient(router).list_workers() == [tiny_server.base_url]
    # what failed: the requests the dead server held when it was killed (cut mid-response)
    # and those the router sent it after the kill, before the rollback took it out (the
    # router answers 500 for a worker it cannot reach); none sent after that; each once:
    # the load generator never resends, and autotune resends nothing
    failed = _failed(run)
    detail = (held_at_kill, summary["lost_requests"], [(r.error, r.detail) for r in failed])
    removed_at = next(e["t"] for e in _events(out) if e["event"] == "drained")
    assert len(failed) <= 4, detail  # the traffic's streams: at most all in flight
    assert all(run.started_at + r.send_s <= removed_at for r in failed), detail
    for r in failed:
        if run.started_at + r.send_s <= killed_at[0]:
            assert r.error in ("disconnected", "http_5xx"), detail
        else:  # sent after the kill: refused by the dead worker, through the router
            assert r.error == "http_5xx" and new.base_url in (r.detail or ""), detail
    assert len({r.index for r in run.records}) == len(run.records)
    # after the rollback every request succeeds again through the old server
    last_fail = max((r.end_s or r.send_s for r in failed), default=0.0)
    later = [r for r in run.records if r.send_s > last_fail + 1.0]
    assert later and all(r.ok for r in later)
