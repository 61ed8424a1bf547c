"""The streaming stub's own HTTP/1.1, spoken to over raw sockets.

The stub stands in for vLLM in the load generator's tests, the fault suite and the capacity
benchmark, so its framing must be right: keep-alive, pipelined requests, chunked streams
with one SSE event per HTTP chunk, clear errors, and counters that match what it sent.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from autotune.testing.stub_server import StubConfig, StubServer, fault_token


class Conn:
    """One client connection that reads whole HTTP responses (Content-Length or chunked)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _take_until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            if not self._fill():
                raise EOFError(f"connection closed before {sep!r}")
        head, self.buf = self.buf.split(sep, 1)
        return head

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise EOFError("connection closed mid-body")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def response(self) -> tuple[int, dict[str, str], list[bytes]]:
        """(status, headers, body pieces): one piece per HTTP chunk, or the whole body."""
        head = self._take_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split(" ")[1])
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding") == "chunked":
            pieces = []
            while True:
                size = int(self._take_until(b"\r\n"), 16)
                if size == 0:
                    assert self._take(2) == b"\r\n"
                    return status, headers, pieces
                pieces.append(self._take(size))
                assert self._take(2) == b"\r\n"
        return status, headers, [self._take(int(headers.get("content-length", "0")))]

    def closed_by_server(self) -> bool:
        try:
            return not self._fill()
        except ConnectionResetError:
            return True


def post(path: str, body: dict | bytes, *, close: bool = False) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    ).encode() + data


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def completion(n: int, *, usage: bool = True, prompt: tuple[int, ...] = (1, 2, 3)) -> dict:
    body: dict = {"model": "tiny", "prompt": list(prompt), "max_tokens": n, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def events(pieces: list[bytes]) -> list[dict | str]:
    """Each HTTP chunk must be exactly one SSE event: ``data: ...\\n\\n``."""
    out: list[dict | str] = []
    for p in pieces:
        assert p.startswith(b"data: ") and p.endswith(b"\n\n") and p.count(b"\n\n") == 1, p
        payload = p[6:-2]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with StubServer(StubConfig(tokens_per_chunk=3, chunks_per_write=4)) as s:
        yield s


@pytest.fixture
def conn(stub: StubServer) -> Iterator[Conn]:
    c = Conn(stub.port)
    yield c
    c.close()


def test_a_stream_is_one_sse_event_per_chunk_with_usage_and_done(conn: Conn) -> None:
    conn.send(post("/v1/completions", completion(10)))
    status, headers, pieces = conn.response()
    assert status == 200 and headers["content-type"] == "text/event-stream"
    evs = events(pieces)
    assert evs[-1] == "[DONE]"
    tokens = [e for e in evs[:-1] if isinstance(e, dict) and e["choices"]]
    # three tokens a chunk (speculative decoding), cumulative usage on every chunk
    assert [e["usage"]["completion_tokens"] for e in tokens] == [3, 6, 9, 10]
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None, None, None, "length"]
    final = evs[-2]
    assert isinstance(final, dict) and final["choices"] == []
    assert final["usage"] == {"prompt_tokens": 3, "total_tokens": 13, "completion_tokens": 10}


def test_chat_starts_with_the_role_chunk(conn: Conn) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "t1 t2"}], "max_tokens": 2}
    conn.send(post("/v1/chat/completions", {**body, "stream": True}))
    status, _, pieces = conn.response()
    evs = events(pieces)
    assert status == 200 and evs[-1] == "[DONE]"
    first = evs[0]
    assert isinstance(first, dict) and first["choices"][0]["delta"]["role"] == "assistant"
    assert first["object"] == "chat.completion.chunk" and first["model"] == "m"
    assert "usage" not in first  # no stream_options asked for


def test_keep_alive_and_pipelined_requests_answer_in_order(conn: Conn) -> None:
    conn.send(get("/health") + post("/v1/completions", completion(4)) + get("/v1/models"))
    assert conn.response()[0] == 200
    status, _, pieces = conn.response()
    assert status == 200 and events(pieces)[-1] == "[DONE]"
    status, _, body = conn.response()
    assert status == 200 and json.loads(body[0])["data"][0]["id"] == "tiny"
    conn.send(post("/v1/completions", completion(5, usage=False)))  # same connection again
    status, _, pieces = conn.response()
    assert status == 200 and len(events(pieces)) == 2 + 1  # 3+2 tokens, [DONE]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (get("/nowhere"), 404),
        (get("/v1/completions"), 405),
        (post("/health", b""), 405),
        (post("/v1/completions", b"{not json"), 400),
        (post("/v1/completions", {"prompt": [1], "max_tokens": 2}), 400),  # stream=false
        (post("/v1/completions", completion(3, prompt=(fault_token("http_500"), 1))), 500),
    ],
)
def test_errors_are_json_and_keep_the_connection(
    conn: Conn, request_bytes: bytes, status: int
) -> None:
    conn.send(request_bytes)
    got, headers, body = conn.response()
    assert got == status and headers["content-type"] == "application/json"
    err = json.loads(body[0])["error"]
    assert err["code"] == status and err["message"]
    conn.send(get("/health"))
    assert conn.response()[0] == 200


def test_a_request_line_it_cannot_parse_closes_the_connection(conn: Conn) -> None:
    conn.send(b"NONSENSE\r\n\r\n")
    status, headers, _ = conn.response()
    assert status == 400 and headers["connection"] == "close"
    assert conn.closed_by_server()


def test_connection_close_is_honoured(conn: Conn) -> None:
    conn.send(post("/v1/completions", completion(2), close=True))
    assert conn.response()[0] == 200
    assert conn.closed_by_server()


def test_disconnect_fault_drops_the_connection_mid_stream(conn: Conn) -> None:
    conn.send(post("/v1/completions", completion(30, prompt=(fault_token("disconnect"), 1))))
    with pytest.raises((EOFError, ConnectionResetError)):
        conn.response()


def test_metrics_count_what_was_streamed(stub: StubServer) -> None:
    c = Conn(stub.port)
    try:
        c.send(get("/metrics"))
        before = c.response()[2][0].decode()
        c.send(post("/v1/completions", completion(7)))
        c.response()
        c.send(get("/metrics"))
        after = c.response()[2][0].decode()
    finally:
        c.close()

    def value(text: str, name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("vllm:generation_tokens_total") == 7
    assert delta("vllm:prompt_tokens_total") == 3
    assert delta("vllm:spec_decode_num_drafts_total") == 3  # chunks of 3, 3, 1 tokens
    assert delta("vllm:spec_decode_num_draft_tokens_total") == 6
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == 4
    assert delta("vllm:request_success_total") == 1
    assert value(after, "vllm:num_requests_running") == 0


def test_interleaved_streams_take_turns_and_complete() -> None:
    """``interleave``: every stream gets one event per turn, as an engine step serves them."""
    from autotune.load import replay
    from autotune.traffic import RequestSpec, Schedule

    # Long streams: the client opens its 8 connections one after another, a few ms apart
    # on a loaded machine. 50 tokens a stream took 0.1-3 ms in all, so a stream that
    # connected late could find the first ones already done (a flake, not a bug); 2,000
    # tokens keep every stream busy for about 150 ms, far longer than the connections take.
    reqs = tuple(RequestSpec(i, (1, 2, 3), 2000) for i in range(8))
    with StubServer(StubConfig(interleave=True)) as s:
        run = replay(
            Schedule(mode="closed", requests=reqs, concurrency=8), base_url=s.base_url, model="tiny"
        )
    assert all(r.ok and r.output_tokens == 2000 for r in run.records)
    # taking turns: every stream's first token came before any stream's last one
    assert max(r.first_token_s for r in run.records) < min(r.chunk_times_s[-1] for r in run.records)
