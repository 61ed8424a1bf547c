"""The Prometheus client and the from-prometheus options: pure logic, no Prometheus.

Where a test needs an HTTP answer it gets one from a small loopback endpoint that speaks
the API's JSON (what Prometheus cannot do here: bearer tokens, chosen errors); the fit
itself is tested against a real Prometheus in tests/integration/test_prometheus.py.
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
from autotune.engine._vllm import free_port
from autotune.traffic import (
    PrometheusAuth,
    PrometheusClient,
    PrometheusError,
    PrometheusUnreachableError,
)
from autotune.traffic import _prometheus as prom_mod


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


