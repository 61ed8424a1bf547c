"""The Prometheus client and the from-prometheus options: pure logic, no Prometheus.

Where a test needs an HTTP answer it gets one from a small loopback endpoint that speaks
the API's JSON (what Prometheus cannot do here: bearer tokens, chosen errors); the fit
itself is tested against a real Prometheus in tests/test_prometheus.py.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from autotune.cli import main
from autotune.cli._from_prometheus import parse_time, resolve_range
from autotune.engine._vllm import free_port
from autotune.errors import ConfigError
from autotune.traffic import (
    LoadSpec,
    PrometheusAuth,
    PrometheusClient,
    PrometheusError,
    PrometheusRange,
    PrometheusUnreachableError,
    SourceInfo,
    auth_from_env,
    constant_shape,
    diff_shapes,
    normalize_selector,
)
from autotune.traffic import _prometheus as prom_mod


@pytest.mark.parametrize(("text", "inner"), [
    (None, ""), ("", ""), ("{}", ""),
    ('{model_name="m"}', 'model_name="m"'),
    ('{ model_name = "m" , namespace=~"prod-.*" }', 'model_name = "m",namespace=~"prod-.*"'),
    ('job!="x",pod!~"a\\"b"', 'job!="x",pod!~"a\\"b"'),
])
def test_selectors_are_normalized(text: str | None, inner: str) -> None:
    assert normalize_selector(text) == inner


@pytest.mark.parametrize("bad", ['{model_name="m"', 'model_name=m', '{a="b" c="d"}',
                                 '{__name__="vllm:x"}', "up{}", '{a="b",}x'])
def test_bad_selectors_say_how_to_write_one(bad: str) -> None:
    with pytest.raises(ConfigError, match="--selector"):
        normalize_selector(bad)


def test_credentials_come_from_the_environment_or_files(tmp_path: Path) -> None:
    assert auth_from_env({}) is None
    a = auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN": "tok"})
    assert a is not None and a.header() == "Bearer tok" and "tok" not in repr(a)
    f = tmp_path / "token"
    f.write_text("from-file\n")
    a = auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN_FILE": str(f)})
    assert a is not None and a.header() == "Bearer from-file"
    a = auth_from_env({"AUTOTUNE_PROMETHEUS_USERNAME": "u",
                       "AUTOTUNE_PROMETHEUS_PASSWORD_FILE": str(f)})
    assert a == PrometheusAuth(username="u", password="from-file")
    assert a.header() == "Basic dTpmcm9tLWZpbGU="
    pair = tmp_path / "basic"
    pair.write_text("user:p:w\n")
    assert auth_from_env({}, basic_auth_file=pair) == PrometheusAuth(username="user",
                                                                     password="p:w")
    assert auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN": "x"},
                         bearer_token_file=f) == PrometheusAuth(bearer_token="from-file")
    with pytest.raises(ConfigError, match="unset one"):
        auth_from_env({"AUTOTUNE_PROMETHEUS_BEARER_TOKEN": "t",
                       "AUTOTUNE_PROMETHEUS_USERNAME": "u"})
    with pytest.raises(ConfigError, match="user:password"):
        auth_from_env({}, basic_auth_file=f)
    with pytest.raises(ConfigError, match="cannot read"):
        auth_from_env({}, bearer_token_file=tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        auth_from_env({}, bearer_token_file=tmp_path / "empty")


def test_a_url_with_credentials_is_refused() -> None:
    with pytest.raises(ConfigError, match="AUTOTUNE_PROMETHEUS_USERNAME"):
        PrometheusClient("http://me:secret@prom:9090")
    with pytest.raises(ConfigError, match="http"):
        PrometheusClient("prom:9090")
    assert PrometheusClient("https://h/prometheus/api/v1/query").url == "https://h/prometheus"


class _Api(BaseHTTPRequestHandler):
    """Answers like Prometheus: a scalar per query, a matrix per range query; records what
    it was asked. ``answers`` maps a query text to (HTTP status, raw body) for errors."""

    seen: ClassVar[list[tuple[str, dict[str, str], str | None]]] = []
    answers: ClassVar[dict[str, tuple[int, bytes]]] = {}

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        self.seen.append((url.path, q, self.headers.get("Authorization")))
        status, body = self.answers.get(q.get("query", ""), (200, b""))
        if not body and url.path.endswith("/query_range"):
            start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
            n = round((end - start) / step) + 1
            values = [[start + i * step, str(i)] for i in range(n)]
            body = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": [
                {"metric": {"job": "a"}, "values": values}]}}).encode()
        elif not body:
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": {"le": "+Inf"}, "value": [float(q["time"]), "7"]}]}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[str]:
    _Api.seen, _Api.answers = [], {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/sub/path"
    finally:
        server.shutdown()
        server.server_close()


def test_queries_send_the_token_and_long_ranges_are_split(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = PrometheusClient(api, auth=PrometheusAuth(bearer_token="tok"))
    [s] = c.query("sum(x)", at=100.0)
    assert s.labels == {"le": "+Inf"} and s.value == 7.0
    assert _Api.seen[-1][0] == "/sub/path/api/v1/query" and _Api.seen[-1][2] == "Bearer tok"
    monkeypatch.setattr(prom_mod, "MAX_POINTS", 4)
    [m] = c.query_range("x", start=0.0, end=9.0, step=1.0)  # 10 steps: 3 requests
    assert len(_Api.seen) == 4 and [t for t, _ in m.points] == [float(i) for i in range(10)]
    assert m.labels == {"job": "a"}


def test_errors_are_one_clear_line(api: str) -> None:
    _Api.answers = {
        "bad": (400, b'{"status":"error","errorType":"bad_data","error":"parse error"}'),
        "auth": (401, b"Unauthorized"),
        "proxy": (502, b"<html>bad gateway</html>"),
        "gone": (404, b"404 page not found"),
    }
    c = PrometheusClient(api)
    with pytest.raises(PrometheusError, match="rejected the query \\(bad_data: parse error"):
        c.query("bad", at=1.0)
    with pytest.raises(PrometheusError, match="AUTOTUNE_PROMETHEUS_BEARER_TOKEN"):
        c.query("auth", at=1.0)
    with pytest.raises(PrometheusUnreachableError, match="HTTP 502"):
        c.query("proxy", at=1.0)
    with pytest.raises(PrometheusError, match="its API under /api/v1"):
        c.query("gone", at=1.0)
    with pytest.raises(PrometheusUnreachableError, match="cannot reach Prometheus"):
        PrometheusClient(f"http://127.0.0.1:{free_port()}", timeout_s=5).query("x", at=1.0)


def test_times_and_ranges() -> None:
    now = 1_800_012_345.0
    assert parse_time("now", now=now, what="--until") == now
    assert parse_time("90s", now=now, what="x") == now - 90
    assert parse_time("7d", now=now, what="x") == now - 7 * 86400
    assert parse_time("2w", now=now, what="x") == now - 14 * 86400
    assert parse_time("1700000000", now=now, what="x") == 1_700_000_000.0
    assert parse_time("2027-01-15T08:00:00Z", now=now, what="x") == 1_800_000_000.0
    assert parse_time("2027-01-15T08:00:00", now=now, what="x") == 1_800_000_000.0
    with pytest.raises(ConfigError, match="--since 'yesterday' is not a time"):
        parse_time("yesterday", now=now, what="--since")
    assert resolve_range("1h", "30m", now=now) == (now - 5400, now - 1800)
    assert resolve_range("2027-01-15T08:00:00Z", "now", now=now) == (1_800_000_000.0, now)
    with pytest.raises(ConfigError, match="must be before"):
        resolve_range("2027-01-15T08:00:00Z", "2027-01-14T08:00:00Z", now=now)


def test_the_cli_says_what_is_wrong_in_one_line(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    out = str(tmp_path / "s.json")
    dead = f"http://127.0.0.1:{free_port()}"
    for argv, needle in [
        ([dead, "--since", "1h"], "cannot reach Prometheus at"),
        ([dead, "--selector", "{model_name=m}"], "is not a label matcher"),
        ([dead, "--since", "later"], "--since 'later' is not a time"),
        (["http://u:p@h:9090"], "carries credentials"),
    ]:
        rc = main(["shape", "from-prometheus", *argv, "-o", out, "--quiet", "--timeout", "5"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and needle in err, (argv, err)
    assert not Path(out).exists()


def _from(selector: str, url: str = "http://p:9090") -> Any:
    rng = PrometheusRange(url=url, selector=selector, start=0, end=60, start_iso="a",
                          end_iso="b", window_s=60)
    shape = constant_shape(100, 10, load=LoadSpec(mode="closed", concurrency=1), requests=5)
    return shape.model_copy(update={"source": SourceInfo(format="prometheus",
                                                         prometheus=rng)})


def test_diff_notes_shapes_of_different_replicas() -> None:
    a, b = _from('{model_name="m"}'), _from('{model_name="n"}', url="http://q:9090")
    d = diff_shapes(a, b)
    assert d.verdict == "same" and len(d.notes) == 2
    assert 'different replicas: ' in d.notes[0] and '{model_name="n"}' in d.notes[0]
    assert diff_shapes(a, a).notes == []
