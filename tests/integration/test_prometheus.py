"""Shapes from a real Prometheus scraping real CPU vLLM servers (slow).

One Prometheus (Debian's package, ``scripts/setup-prometheus.sh``) on loopback with a 1-s
scrape interval, two replicas: the session's ``tiny_server`` (job ``replica-a``) and one
more started here (job ``replica-b``). autotune's load generator replays ``example-chat``'s
lengths paced across both, replica b is restarted mid-range, and:

- ``autotune shape from-prometheus`` over the range agrees with the replay's own records
  within the precision the shape states (requests, rate, lengths' quantiles, burstiness),
  reports the restart, sums the replicas (a selector of one replica gives its half) and
  records the URL, selector, range and queries;
- an empty selector and a range with no data are one line each, exit 2;
- ``autotune watch --prometheus`` fires its drift action once on a switched trace.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from autotune.cli import main
from autotune.engine import VllmServer
from autotune.load import replay
from autotune.testing.prometheus_server import PrometheusServer, prometheus_binary
from autotune.traffic import (
    LoadSpec,
    PrometheusAuth,
    PrometheusClient,
    Schedule,
    TraceRecords,
    TrafficShape,
    build_schedule,
    diff_shapes,
    fit_prometheus,
    fit_shape,
    load_shape,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(prometheus_binary() is None,
                       reason="no prometheus binary (scripts/setup-prometheus.sh installs it)"),
]

REPO = Path(__file__).resolve().parents[2]
VOCAB = 4000
SELECTOR = '{model_name="autotune-model"}'


@dataclasses.dataclass
class Fleet:
    a: Any
    b: VllmServer
    prom: PrometheusServer
    auth: PrometheusAuth | None  # Prometheus asks for basic auth where crypt() has bcrypt
    auth_file: Path | None


def _prometheus(targets: dict[str, str], tmp: Path) -> tuple[PrometheusServer, Any, Any]:
    try:
        prom = PrometheusServer(targets=targets, scrape_interval_s=1.0,
                                basic_auth=("autotune", "s3cret"))
        prom.start()
    except (ImportError, RuntimeError):  # no bcrypt here: a Prometheus without auth
        prom = PrometheusServer(targets=targets, scrape_interval_s=1.0)
        prom.start()
        return prom, None, None
    (tmp / "basic").write_text("autotune:s3cret\n")
    return prom, PrometheusAuth(username="autotune", password="s3cret"), tmp / "basic"


@pytest.fixture
def creds(fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The credentials in the environment, the password in a file."""
    if fleet.auth is not None:
        (tmp_path / "pw").write_text("s3cret\n")
        monkeypatch.setenv("AUTOTUNE_PROMETHEUS_USERNAME", "autotune")
        monkeypatch.setenv("AUTOTUNE_PROMETHEUS_PASSWORD_FILE", str(tmp_path / "pw"))


@pytest.fixture(scope="module")
def fleet(_tiny_server_session: Any, tiny_llama: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Any:
    from autotune.engine._vllm import free_port

    tiny_server = _tiny_server_session  # the session's server, up again if a test killed it
    if tiny_server.poll() is not None:
        tiny_server.stop()
        tiny_server.start()
        tiny_server.wait_healthy()

    b = VllmServer(model=str(tiny_llama), flags=["--max-model-len", "1024", "-O0"],
                   port=free_port(), log_path=tmp_path_factory.mktemp("b") / "server.log",
                   start_timeout_s=400.0)
    b.start()
    prom = None
    try:
        b.wait_healthy()
        prom, auth, auth_file = _prometheus({"replica-a": tiny_server.base_url[7:],
                                             "replica-b": b.base_url[7:]},
                                            tmp_path_factory.mktemp("auth"))
        # a few scrapes before the range starts, counted from the first: that lands 5-10 s
        # after ready (Prometheus' 5-s discovery and reload tickers), so a fixed sleep from
        # ready left a range whose first 60 s window ended just after the traffic began without
        # a sample, and the shape rightly started a window late
        prom.wait_scraped()
        time.sleep(3.0)
        yield Fleet(tiny_server, b, prom, auth, auth_file)
    finally:
        if prom is not None:
            prom.stop()
        b.stop()


def _paced(shape: TrafficShape, *, n: int, rate: float, seed: int, offset: float = 0.0
           ) -> Schedule:
    s = build_schedule(shape.with_load(LoadSpec(mode="closed", concurrency=1, requests=n)),
                       vocab_size=VOCAB, seed=seed, max_input_tokens=512,
                       max_output_tokens=48)
    reqs = tuple(dataclasses.replace(r, send_at_s=offset + i / rate)
                 for i, r in enumerate(s.requests))
    return Schedule(mode="open", requests=reqs, seed=seed)


def _both(fleet: Fleet, shape: TrafficShape, *, n: int, rate: float, seed: int
          ) -> list[tuple[float, Any]]:
    """``n`` requests at ``rate``/s in all, alternating replicas; (send time, request)."""
    scheds = [_paced(shape, n=n // 2, rate=rate / 2, seed=seed + k, offset=k / rate)
              for k in range(2)]
    t0 = time.time()
    errors: list[str] = []

    def run(k: int, server: Any) -> None:
        res = replay(scheds[k], base_url=server.base_url, model=server.served_model_name)
        errors.extend(str(r.error) for r in res.records if not r.ok)

    threads = [threading.Thread(target=run, args=(k, s)) for k, s in enumerate((fleet.a,
                                                                                fleet.b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    return [(t0 + (r.send_at_s or 0.0), r) for s in scheds for r in s.requests]


def _replayed(sent: list[tuple[float, Any]]) -> TrafficShape:
    sent = sorted(sent, key=lambda x: x[0])
    return fit_shape(TraceRecords(
        path="replayed", format="schedule",
        timestamps_s=np.asarray([t for t, _ in sent], dtype=np.float64),
        input_tokens=np.asarray([len(r.prompt_token_ids) for _, r in sent], dtype=np.int64),
        output_tokens=np.asarray([r.max_tokens for _, r in sent], dtype=np.int64),
    ))


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_fleet_shape_agrees_with_the_replay_through_a_restart(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chat = load_shape(REPO / "traffic" / "example-chat.json")
    # whole 60 s windows from just before the traffic (Prometheus has scraped both replicas
    # since a few seconds before: the fixture waited for it), at least two of them: 20
    # requests at 1/s and the restart in the first, 40 at 2/s from the second on, so the
    # windows' counts differ however fast the restart is (a range sized to the traffic held
    # one window when the restart took seconds, and a single window has no dispersion)
    start = math.floor(time.time()) - 1
    sent = _both(fleet, chat, n=20, rate=1.0, seed=1)
    # what a replica serves after its last scrape is lost with it: stop b once Prometheus
    # has its last request (a loaded /metrics may miss its 1 s scrape timeout)
    client = PrometheusClient(fleet.prom.url, auth=fleet.auth)
    deadline = time.time() + 30
    while time.time() < deadline and sum(s.value for s in client.query(
            'vllm:request_prompt_tokens_count{job="replica-b"}', at=time.time())) < 10:
        time.sleep(0.5)
    errors = fleet.b.stop(grace_s=5.0)  # replica b restarts: its counters start again at 0
    assert all("ignored SIGTERM" in e for e in errors), errors
    fleet.b.start()
    fleet.b.wait_healthy()
    time.sleep(max(0.0, start + 62.0 - time.time()))  # the second window
    sent += _both(fleet, chat, n=40, rate=2.0, seed=3)
    end = start + 60 * max(2, math.ceil((time.time() + 2.0 - start) / 60))
    time.sleep(max(0.0, end + 3.0 - time.time()))  # the last scrapes are in
    out = tmp_path / "fleet.json"
    auth = ["--basic-auth-file", str(fleet.auth_file)] if fleet.auth_file else []
    rc, text, err = _cli(capsys, "shape", "from-prometheus", fleet.prom.url, "--since",
                         str(start), "--until", str(end), "--selector", SELECTOR,
                         "-o", str(out), *auth)
    print(err, text)
    assert rc == 0, err
    live, replayed = load_shape(out), _replayed(sent)
    assert live.precision is not None and live.precision.rate is not None
    rate_prec = live.precision.rate
    # requests and rate: increase() extrapolates by up to a scrape per replica and end,
    # and a request the restarted replica finished after its last scrape is lost with it
    # (1 of 60 in two runs, 2 of 60 under a heavier load: scrapes of a busy /metrics time
    # out, so the last good scrape before the restart comes earlier); up to 3 allowed
    restart_loss = 3
    lost = 60 - live.requests
    assert -(1 + 60 * rate_prec) <= lost <= 1 + 60 * rate_prec + restart_loss, live.requests
    assert live.rate_rps == pytest.approx(60 / (end - start),
                                          rel=rate_prec + 0.02 + restart_loss / 60)
    # lengths: the means are sum/count (exact but for that one request); quantiles within
    # the stated bound
    assert live.input_tokens.mean == pytest.approx(replayed.input_tokens.mean, rel=0.05)
    assert live.output_tokens.mean == pytest.approx(replayed.output_tokens.mean, rel=0.05)
    d = diff_shapes(replayed, live)
    print({k: (v.distance, v.threshold) for k, v in d.dimensions.items()})
    assert d.dimensions["input_tokens"].distance <= live.precision.input_tokens  # type: ignore[operator]
    assert d.dimensions["output_tokens"].distance <= live.precision.output_tokens  # type: ignore[operator]
    # burstiness: the same 60 s windows of the replay's own send times
    rel = np.asarray([t for t, _ in sent]) - start
    k = round((end - start) / 60)
    counts = np.bincount(np.floor(rel / 60).astype(int), minlength=k)[:k]
    assert live.arrivals is not None and live.arrivals.dispersion_60s is not None
    window_counts = [v * 60 for v in live.arrivals.rate_profile]
    assert len(window_counts) == k and all(
        abs(c - o) <= 2 + 0.05 * o for c, o in zip(window_counts, counts, strict=True)), (
        window_counts, counts.tolist())  # a first token may cross a window's edge
    own = float(counts.var() / counts.mean())
    if own >= 1.0:  # the restart's timing may leave the windows nearly even
        assert abs(math.log2(live.arrivals.dispersion_60s / own)) <= 1.0, (own, live.arrivals)
    # (no whole-shape diff: the replay's own fit spans its send times, the Prometheus shape
    # the whole range with its idle tail, so their rates differ by design; the lengths and
    # the per-window arrivals are checked above)
    # the restart and the fleet are reported; the range is recorded
    assert "from 2 replica series" in text
    restarts = [ln for ln in text.splitlines() if ln.strip().startswith("restart:")]
    assert len(restarts) == 1 and 'job="replica-b"' in restarts[0], text
    rng = live.source.prometheus if live.source else None
    assert rng is not None and rng.selector == SELECTOR and rng.replicas == 2
    assert (rng.start, rng.end) == (start, end) and rng.url == fleet.prom.url
    assert "sum by (le) (increase(vllm:request_prompt_tokens_bucket{" in rng.queries[
        "prompt_tokens"]
    # one replica's selector: its half of the requests
    half = fit_prometheus(client, start=start, end=end,
                          selector='{job="replica-b"}')
    assert abs(half.shape.requests - 30) <= 1 and len(half.resets) == 1


def test_an_empty_selector_and_a_range_without_data_are_one_line_each(
    fleet: Fleet, creds: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, out = fleet.prom.url, str(tmp_path / "x.json")
    rc, text, err = _cli(capsys, "shape", "from-prometheus", url, "--since", "10m",
                         "--selector", '{model_name="no-such-model"}', "-o", out, "--quiet")
    assert rc == 2 and text == "", (text, err)
    assert err.count("\n") == 1 and "matches no vLLM series" in err and "fix --selector" in err
    assert "model_name" in err  # the labels the series do have
    rc, text, err = _cli(capsys, "shape", "from-prometheus", url, "--since", "2d", "--until",
                         "1d", "-o", out, "--quiet")
    assert rc == 2 and err.count("\n") == 1 and "has no vLLM data between" in err, err
    if fleet.auth is not None:  # credentials refused: which variables to set
        monkeypatch.delenv("AUTOTUNE_PROMETHEUS_PASSWORD_FILE")
        monkeypatch.setenv("AUTOTUNE_PROMETHEUS_PASSWORD", "wrong")
        rc, text, err = _cli(capsys, "shape", "from-prometheus", url, "-o", out, "--quiet")
        assert rc == 2 and err.count("\n") == 1 and "HTTP 401" in err, err
    assert not Path(out).exists()


def test_watch_prometheus_fires_once_on_a_switched_trace(
    fleet: Fleet, creds: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = load_shape(REPO / "traffic" / "example-chat.json")
    short = base.model_copy(update={"input_tokens": _scaled(base.input_tokens, 0.15),
                                    "output_tokens": _scaled(base.output_tokens, 0.2)})
    mode = {"shape": short}
    stop = threading.Event()
    a = fleet.a

    def drive() -> None:
        k = 0
        while not stop.is_set():
            replay(_paced(mode["shape"], n=6, rate=3.0, seed=100 + k), base_url=a.base_url,
                   model=a.served_model_name)
            k += 1

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        time.sleep(17.0)
        tuned = tmp_path / "tuned.json"
        rc, _, err = _cli(capsys, "shape", "from-prometheus", fleet.prom.url, "--since",
                          "15s", "--until", "2s", "--selector", SELECTOR, "-o", str(tuned))
        assert rc == 0, err
        fired = tmp_path / "fired.txt"
        timer = threading.Timer(1.0, lambda: mode.update(shape=base))  # after check 1
        timer.start()
        rc, text, err = _cli(capsys, "watch", "--prometheus", fleet.prom.url, "--tuned",
                             str(tuned), "--every", "15s", "--lag", "2s", "--checks", "3",
                             "--no-mlflow", "--out", str(tmp_path / "w"), "--on-drift",
                             f"echo {{shape}} >> {fired}")
        timer.cancel()
    finally:
        stop.set()
        driver.join()
    print(text, err)
    assert rc == 0, err
    assert f"selector {SELECTOR}: the one the tuned shape" in text
    states = [json.loads(ln) for ln in (tmp_path / "w" / "watch.jsonl").read_text()
              .splitlines()]
    checks = [s for s in states if s["event"] == "state" and s["state"] in ("same",
                                                                            "drifted")]
    assert len(checks) == 3, states
    assert not {"input_tokens", "output_tokens"} & set(checks[0]["drifted_dimensions"])
    assert checks[-1]["state"] == "drifted" and "input_tokens" in checks[-1][
        "drifted_dimensions"], checks
    actions = [s["action"] for s in checks if s["action"]]
    assert len(actions) == 1 and "exit 0" in actions[0], checks
    assert len(fired.read_text().splitlines()) == 1


def _scaled(d: Any, f: float) -> Any:
    q = [max(1.0, round(v * f)) for v in d.quantiles]
    return d.model_copy(update={"quantiles": q, "mean": float(np.mean(q)), "min": q[0],
                                "p50": q[50], "p90": q[90], "p99": q[99], "max": q[100]})
