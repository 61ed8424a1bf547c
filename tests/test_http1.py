"""The load generator's HTTP/1.1 wire (autotune._http1): framing, keep-alive, failures.

The parser is checked on every way a response can be cut into socket reads; the rest runs
against small real servers on loopback that answer with scripted bytes.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from autotune.load import Pool, RequestFailure, Target, _Conn
from autotune.testing.stub_server import _chunk, _plan
from autotune.load import replay
from autotune.traffic import RequestSpec, Schedule

# --- the parser, fed every way a response can arrive ------------------------------------------


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


# --- against scripted servers on loopback -----------------------------------------------------

Script = Callable[[socket.socket, int], None]  # (accepted socket, connection number)


@pytest.fixture
def scripted() -> Iterator[Callable[[Script], str]]:
    """A loopback server that runs ``script`` on every accepted connection (in a thread)."""
    socks: list[socket.socket] = []

    def start(script: Script) -> str:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        socks.append(srv)

        def serve() -> None:
            n = 0
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                threading.Thread(target=script, args=(conn, n), daemon=True).start()
                n += 1

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{srv.getsockname()[1]}"

    yield start
    for s in socks:
        s.close()


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(65536)
        if not more:
            return b""
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head


def sse_body(n: int) -> bytes:
    events = [
        b'data: {"choices":[{"text":" t","finish_reason":null}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n' % (i + 1)
        for i in range(n)
    ]
    return b"".join(events) + b"data: [DONE]\n\n"


def schedule(n: int, conc: int) -> Schedule:
    return Schedule(
        mode="closed",
        requests=tuple(RequestSpec(i, (1, 2, 3), 4) for i in range(n)),
        concurrency=conc,
    )


def test_content_length_and_until_close_bodies(scripted: Callable[[Script], str]) -> None:
    body = sse_body(4)

    def script(conn: socket.socket, n: int) -> None:
        with conn:
            while read_request(conn):
                if n % 2 == 0:  # framed by Content-Length, connection kept
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                    conn.sendall(body)
                else:  # HTTP/1.0 style: the body ends when the connection does
                    conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + body)
                    return

    run = replay(schedule(6, 2), base_url=scripted(script), model="m")
    assert all(r.ok and r.output_tokens == 4 and r.prompt_tokens == 3 for r in run.records), [
        (r.error, r.detail) for r in run.records
    ]


def test_a_keep_alive_connection_the_server_closed_is_replaced(
    scripted: Callable[[Script], str],
) -> None:
    """The server answers one request per connection and closes it without saying so
    (as uvicorn does after its keep-alive timeout): the next request must go out on a
    fresh connection, not fail."""
    body = sse_body(2)
    seen: list[int] = []

    def script(conn: socket.socket, n: int) -> None:
        with conn:
            if read_request(conn):
                seen.append(n)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + _chunk(body)
                    + b"0\r\n\r\n"
                )
                time.sleep(0.05)

    target = Target(scripted(script))
    head = target.post_head("/v1/completions", 2, {})

    async def go_real() -> list[int]:
        pool = Pool(target, t0=time.monotonic())
        out = []
        for _ in range(3):
            out.append(await pool.request(head + b"{}", lambda d, t: None, timeout_s=5, stall_s=5))
            await asyncio.sleep(0.2)
        pool.close()
        return out

    assert asyncio.run(go_real()) == [200, 200, 200]
    assert sorted(seen) == [0, 1, 2]  # three connections, one request each


def test_silence_before_the_head_is_a_stall(scripted: Callable[[Script], str]) -> None:
    def script(conn: socket.socket, n: int) -> None:
        with conn:
            read_request(conn)
            time.sleep(2.0)

    t = time.monotonic()
    run = replay(schedule(2, 2), base_url=scripted(script), model="m", stall_timeout_s=0.3)
    assert time.monotonic() - t < 1.5
    assert [r.error for r in run.records] == ["stalled", "stalled"]
    assert all("response head" in (r.detail or "") and r.status is None for r in run.records)


def test_a_connection_closed_before_any_answer_is_disconnected(
    scripted: Callable[[Script], str],
) -> None:
    def script(conn: socket.socket, n: int) -> None:
        with conn:
            read_request(conn)  # then close without a word

    run = replay(schedule(2, 1), base_url=scripted(script), model="m")
    assert [r.error for r in run.records] == ["disconnected", "disconnected"]
    assert all("before the response" in (r.detail or "") for r in run.records)
