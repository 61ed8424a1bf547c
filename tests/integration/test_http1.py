"""The load generator's HTTP/1.1 wire (autotune._http1): framing, keep-alive, failures.

The parser is checked on every way a response can be cut into socket reads; the rest runs
against small real servers on loopback that answer with scripted bytes.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from autotune.load import Pool, Target, replay
from autotune.testing.stub_server import _chunk
from autotune.traffic import RequestSpec, Schedule

# --- the parser, fed every way a response can arrive ------------------------------------------


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
