"""autotune.watch against a fake /metrics endpoint (fast): drift episodes, the endpoint
going away and coming back, the JSON lines log, MLflow, --on-drift, the CLI and Ctrl-C.

The endpoint is a small HTTP server in the test serving a vLLM-format page whose counters
grow at a steady rate; the real-vLLM tests are in test_watch_vllm.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from autotune.traffic import ShapeDiff, TrafficShape, load_shape
from tests.faults._lab import _default_sigint
from autotune.watch import (
    JsonlLog,
    WatchEvent,
    WatchSummary,
    run_command,
    sample_shape,
    watch,
)
from tests._vllm_metrics_text import metrics_text

REPO = Path(__file__).resolve().parents[2]
SPACE = str(REPO / "search_spaces" / "cpu.yaml")
MODES = {"short": ([30.0, 60.0, 120.0], [8.0, 16.0, 30.0]),
         "long": ([300.0, 450.0, 700.0], [60.0, 120.0, 300.0])}


class FakeVllm:
    """Serves /metrics; requests of the current mode finish at ``rate_rps`` a second.

    Paced by the clock, as real traffic is, not by the scrapes: with a fixed count per
    scrape, a window whose last scrape came late on a loaded machine (its duration 0.76 s
    instead of 0.6 s, no more requests) read a rate 25% low and "drifted". Now a late scrape
    sees the requests of the extra time too."""

    def __init__(self, port: int = 0, rate_rps: float = 60.0) -> None:
        self.mode = "short"
        self.rate_rps = rate_rps
        self.prompt: list[float] = []
        self.output: list[float] = []
        self.lock = threading.Lock()
        self.port = port
        self.server: ThreadingHTTPServer | None = None
        self.start()

    def page(self) -> str:
        with self.lock:
            now = time.monotonic()
            self.due += (now - self.since) * self.rate_rps
            self.since = now
            p, o = MODES[self.mode]
            for _ in range(int(self.due)):
                i = len(self.prompt) % 3
                self.prompt.append(p[i])
                self.output.append(o[i])
            self.due -= int(self.due)
            return metrics_text(self.prompt, self.output)

    def start(self) -> None:
        fake = self
        with self.lock:  # requests count from the start (a restart is not a backlog)
            self.since, self.due = time.monotonic(), 0.0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = fake.page().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.allow_reuse_address = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self, *, reset: bool = True) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
        if reset:  # a restarted server counts from 0
            self.prompt, self.output = [], []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    f = FakeVllm()
    yield f
    if f.server is not None and f.server.socket.fileno() != -1:  # not stopped by the test
        f.stop()


@pytest.fixture
def tuned_short(fake: FakeVllm, tmp_path: Path) -> TrafficShape:
    return sample_shape(url=fake.url, duration_s=0.6, interval_s=0.1, name="tuned-short")


class Steer:
    """A watch subscriber that switches the fake's traffic after given checks."""

    def __init__(self, fake: FakeVllm, plan: dict[int, str]) -> None:
        self.fake, self.plan = fake, plan
        self.events: list[WatchEvent] = []

    def on_start(self, **kw: Any) -> None:
        self.fake.mode = self.plan.get(0, self.fake.mode)

    def on_event(self, ev: WatchEvent, diff: ShapeDiff | None) -> None:
        self.events.append(ev)
        if ev.check in self.plan and ev.state in ("same", "drifted"):
            self.fake.mode = self.plan[ev.check]

    def on_end(self, summary: WatchSummary) -> None:
        pass


def test_drift_action_once_per_episode_rearmed_by_same(
    fake: FakeVllm, tuned_short: TrafficShape, tmp_path: Path
) -> None:
    # windows: short, long, long, long, short, long -> actions on windows 2 and 6 only
    steer = Steer(fake, {0: "short", 1: "long", 4: "short", 5: "long"})
    fired: list[Path] = []

    def act(shape: TrafficShape, path: Path, diff: ShapeDiff) -> str:
        fired.append(path)
        return "acted"

    s = watch(url=fake.url, tuned=tuned_short, every_s=0.6, interval_s=0.1,
              shapes_dir=tmp_path / "w", on_drift=act, max_checks=6,
              callbacks=[steer, JsonlLog(tmp_path / "w" / "watch.jsonl")])
    states = [e.state for e in steer.events]
    assert states == ["same", "drifted", "drifted", "drifted", "same", "drifted"], states
    assert [e.action for e in steer.events] == [None, "acted", None, None, None, "acted"]
    assert s.actions == 2 and s.drifted == 4 and s.same == 2 and not s.interrupted
    assert [p.name for p in fired] == [Path(steer.events[i].shape_path or "").name
                                       for i in (1, 5)]
    assert "input_tokens" in steer.events[1].drifted_dimensions
    assert load_shape(fired[0]).input_tokens.mean > 300  # the saved shape is the new traffic
    lines = [json.loads(x) for x in (tmp_path / "w" / "watch.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["start"] + ["state"] * 6 + ["end"]
    assert lines[2]["state"] == "drifted" and lines[2]["armed"] is False


def test_the_endpoint_going_away_and_coming_back(
    fake: FakeVllm, tuned_short: TrafficShape, tmp_path: Path
) -> None:
    events: list[WatchEvent] = []

    class Outage(Steer):
        def on_event(self, ev: WatchEvent, diff: ShapeDiff | None) -> None:
            events.append(ev)
            if ev.check == 1 and ev.state == "same" and len(events) == 1:
                self.fake.stop()  # gone; back (restarted, counters from 0) 2.5 s later,
                threading.Timer(2.5, self.fake.start).start()  # after the 0.5 s window

    s = watch(url=fake.url, tuned=tuned_short, every_s=0.5, interval_s=0.1,
              shapes_dir=tmp_path, max_checks=3, backoff_s=(0.2, 0.4),
              callbacks=[Outage(fake, {})])
    states = [e.state for e in events]
    assert states[0] == "same" and states[-2:] == ["same", "same"], states
    gone = states[1:-2]
    assert gone and set(gone) == {"unreachable"}, states
    assert "cannot reach" in (events[1].message or "") and "retrying in 0.2 s" in (
        events[1].message or "")
    if len(gone) > 2:  # the delay doubles up to the cap
        assert "retrying in 0.4 s" in (events[-3].message or "")
    assert s.checks == 3 and s.unreachable == len(gone)


def test_idle_windows_are_not_comparisons(tuned_short: TrafficShape, fake: FakeVllm,
                                          tmp_path: Path) -> None:
    fake.rate_rps = 0
    s = watch(url=fake.url, tuned=tuned_short, every_s=0.3, interval_s=0.1,
              shapes_dir=tmp_path, max_checks=1, stop=_stop_after(1.0))
    assert s.checks == 0 and s.idle >= 2 and s.interrupted
    assert "no request finished" in (s.events[0].message or "")


def _stop_after(seconds: float) -> threading.Event:
    ev = threading.Event()
    threading.Timer(seconds, ev.set).start()
    return ev


def test_run_command_passes_the_shape(tmp_path: Path, tuned_short: TrafficShape) -> None:
    from autotune.traffic import diff_shapes

    d = diff_shapes(tuned_short, tuned_short)
    out = tmp_path / "got.txt"
    shape = tmp_path / "new shape.json"
    rc = run_command(f"printf '%s|%s|%s' \"$AUTOTUNE_SHAPE\" \"$AUTOTUNE_TUNED_SHAPE\" "
                     f"{{shape}} > {out}", shape,
                     d, tuned_path="t.json")
    assert rc == 0 and out.read_text().strip() == f"{shape}|t.json|{shape}"
    rc = run_command(f"sh -c 'echo \"$1\" > {out}; exit 3' x", shape, d)
    assert rc == 3 and out.read_text().strip() == str(shape)  # appended as the last argument


def test_mlflow_run_per_watch(fake: FakeVllm, tuned_short: TrafficShape, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from autotune.watch import MlflowWatchLog

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    steer = Steer(fake, {1: "long"})
    watch(url=fake.url, tuned=tuned_short, every_s=0.4, interval_s=0.1, shapes_dir=tmp_path,
          max_checks=2, callbacks=[steer, MlflowWatchLog(uri)])
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("autotune-watch")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    hist = client.get_metric_history(runs[0].info.run_id, "distance")
    assert [m.step for m in hist] == [1, 2]
    drifted = client.get_metric_history(runs[0].info.run_id, "drifted")
    assert [m.value for m in sorted(drifted, key=lambda m: m.step)] == [0.0, 1.0]
    assert runs[0].data.params["tuned_fingerprint"] == tuned_short.fingerprint


def _cli(*args: str, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Ctrl-C as in a terminal even when the test run itself was started in the background
    # (which inherits SIGINT ignored; the fault lab does the same)
    return subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=kw.get("cwd"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=False, preexec_fn=_default_sigint)


def test_cli_watch_checks_then_ctrl_c(fake: FakeVllm, tuned_short: TrafficShape,
                                      tmp_path: Path) -> None:
    from autotune.traffic import save_shape

    tuned = save_shape(tuned_short, tmp_path / "tuned.json")
    p = _cli("watch", fake.url, "--tuned", str(tuned), "--every", "0.5", "--interval", "0.1",
             "--checks", "2", "--no-mlflow", "--out", str(tmp_path / "o"), "--model", "m",
             "--space", SPACE)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.count(" check ") == 2 and "2 comparison(s) (2 same" in out, out
    # drifted traffic: the retune command, printed once; then Ctrl-C: 130 and a summary
    fake.mode = "long"
    p = _cli("watch", fake.url, "--tuned", str(tuned), "--every", "0.4", "--interval", "0.1",
             "--no-mlflow", "--out", str(tmp_path / "o2"), "--model", "m", "--space", SPACE)
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline and seen.count(" check ") < 3:
        line = p.stdout.readline() if p.stdout else ""
        seen += line
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    out = seen + out
    assert p.returncode == 130, err
    assert out.count("re-tune with:") == 1, out
    assert f"autotune retune --model m --space {SPACE} --shape" in out
    assert "watch interrupted:" in out and "1 drift action(s)" in out
    assert "Traceback" not in err


def test_cli_from_metrics(fake: FakeVllm, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    out = str(tmp_path / "s.json")
    assert main(["shape", "from-metrics", "http://127.0.0.1:9", "--duration", "1", "-o", out]) == 2
    assert "autotune: error: cannot reach http://127.0.0.1:9/metrics" in capsys.readouterr().err
    fake.rate_rps = 0
    assert main(["shape", "from-metrics", fake.url, "--duration", "0.5", "--interval", "0.1",
                 "-o", out]) == 2
    assert "no request finished" in capsys.readouterr().err
    fake.rate_rps = 40
    assert main(["shape", "from-metrics", fake.url, "--duration", "0.6", "--interval", "0.1",
                 "-o", out]) == 0
    cap = capsys.readouterr()
    assert "built from" in cap.out and "[0:01 / 0:01]" in cap.err and "samples" in cap.err
    shape = load_shape(out)
    assert shape.source is not None and shape.source.format == "vllm_metrics"
    assert shape.precision is not None


def test_tuned_study_resolves_to_its_shape(tmp_path: Path, tuned_short: TrafficShape) -> None:
    """--tuned STUDY: the shape file the study recorded (and its model for the command)."""
    import optuna

    from autotune.cli._watch import _tuned
    from autotune.errors import ConfigError
    from autotune.study import A
    from autotune.traffic import save_shape

    path = save_shape(tuned_short, tmp_path / "tuned.json")
    storage = f"sqlite:///{tmp_path}/s.db"
    st = optuna.create_study(study_name="prod-1", storage=storage)
    st.set_user_attr(A.SHAPE, tuned_short.fingerprint)
    st.set_user_attr(A.SHAPE_PATH, str(path))
    st.set_user_attr(A.MODEL, "models/m")
    shape, shape_path, study = _tuned("prod-1", storage)
    assert shape.fingerprint == tuned_short.fingerprint and shape_path == str(path)
    assert study is not None and study.model == "models/m"
    assert _tuned(str(path), storage)[0].fingerprint == tuned_short.fingerprint
    with pytest.raises(ConfigError, match="neither a shape file"):
        _tuned("nope", storage)
