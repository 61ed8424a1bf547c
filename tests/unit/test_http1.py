"""The load generator's HTTP/1.1 wire (autotune._http1): framing, keep-alive, failures. (the pure part: no server, no subprocess; the rest is tests/integration/test_http1.py)"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from autotune.load import RequestFailure, Target, _Conn
from autotune.testing.stub_server import _plan


def stub_response(n_out: int = 5) -> tuple[bytes, bytes]:
    """(raw chunked response as the stub sends it, the payload the sink must see)."""
    _, writes, tail = _plan(
        chat=False,
        model="tiny",
        n_prompt=3,
        n_out=n_out,
        k=1,
        per_write=1,
        fault="ok",
        include_usage=True,
        continuous=True,
    )
    raw = b"".join(w.data for w in writes) + tail
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    payload, pos = [], 0
    while True:  # de-chunk by hand
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol], 16)
        if size == 0:
            break
        payload.append(raw[eol + 2 : eol + 2 + size])
        pos = eol + 2 + size + 2
    return head + b"\r\n" + raw, b"".join(payload)


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True


def feed_all(pieces: list[bytes]) -> tuple[asyncio.Future[int], bytes, _Conn]:
    loop = asyncio.new_event_loop()
    try:
        conn = _Conn(time.monotonic, 0.0)
        conn.connection_made(FakeTransport())  # type: ignore[arg-type]
        got: list[bytes] = []
        conn.fut = loop.create_future()
        conn.sink = lambda data, now: got.append(data)
        for p in pieces:
            conn.data_received(p)
        return conn.fut, b"".join(got), conn
    finally:
        loop.close()


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def test_every_single_cut_point_gives_the_same_payload() -> None:
    raw, payload = stub_response()
    for cut in range(1, len(raw)):
        fut, got, conn = feed_all(splits(raw, [cut]))
        assert fut.done() and fut.result() == 200, cut
        assert got == payload, cut
        assert conn.keep


def test_byte_by_byte_and_random_cuts() -> None:
    raw, payload = stub_response(40)
    fut, got, _ = feed_all([raw[i : i + 1] for i in range(len(raw))])
    assert fut.result() == 200 and got == payload
    rng = random.Random(7)
    for _ in range(200):
        cuts = rng.sample(range(1, len(raw)), rng.randint(1, 30))
        fut, got, _ = feed_all(splits(raw, cuts))
        assert fut.result() == 200 and got == payload


def test_one_read_per_chunk_as_a_streaming_server_writes() -> None:
    raw, payload = stub_response(12)
    head_end = raw.index(b"\r\n\r\n") + 4
    pieces, pos = [raw[:head_end]], head_end
    while pos < len(raw):  # cut exactly at every chunk boundary
        eol = raw.index(b"\r\n", pos)
        end = eol + 2 + int(raw[pos:eol], 16) + 2
        pieces.append(raw[pos:end])
        pos = end
    assert len(pieces) > 12
    fut, got, conn = feed_all(pieces)
    assert fut.result() == 200 and got == payload and conn.keep


def test_chunk_extensions_trailers_and_1xx_are_understood() -> None:
    body = b"data: {}\n\n"
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x;ext=1\r\n" % len(body)
        + body
        + b"\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )
    fut, got, conn = feed_all([raw])
    assert fut.result() == 200 and got == body and conn.keep


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x response"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk-size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "not followed by CRLF"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "bad Content-Length"),
    ],
)
def test_broken_framing_fails_the_request_and_drops_the_connection(raw: bytes, detail: str) -> None:
    fut, _, conn = feed_all([raw])
    exc = fut.exception()
    assert isinstance(exc, RequestFailure) and exc.reason == "client_error"
    assert detail in exc.detail
    assert conn.transport.aborted  # type: ignore[union-attr]


def test_an_error_status_keeps_its_body_as_the_detail() -> None:
    body = b'{"error": {"message": "model is too busy"}}'
    raw = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    fut, got, conn = feed_all(splits(raw, [30, 60]))
    exc = fut.exception()
    assert isinstance(exc, RequestFailure) and exc.reason == "http_5xx"
    assert "HTTP 503" in exc.detail and "too busy" in exc.detail and got == b""
    assert conn.reusable  # a complete error response leaves the connection usable


def test_a_bodyless_status_completes_at_once() -> None:
    fut, _, conn = feed_all([b"HTTP/1.1 204 No Content\r\n\r\n"])
    exc = fut.exception()
    assert isinstance(exc, RequestFailure) and exc.reason == "http_other" and "204" in exc.detail
    assert conn.reusable


def test_target_parses_urls() -> None:
    t = Target("http://example.org/prefix")
    assert (t.host, t.port, t.path, t.authority, t.ssl) == (
        "example.org",
        80,
        "/prefix",
        "example.org",
        None,
    )
    t = Target("https://[::1]:8443")
    assert (t.host, t.port, t.authority) == ("::1", 8443, "[::1]:8443") and t.ssl is not None
    with pytest.raises(ValueError, match="not an http"):
        Target("ftp://x")
