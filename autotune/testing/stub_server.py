"""A fast OpenAI-compatible streaming stub server that can misbehave on purpose.

It streams canned tokens in vLLM's SSE format for ``/v1/completions`` and
``/v1/chat/completions``, answers ``/v1/models``, ``/health`` and ``/metrics`` (a few
``vllm:`` series that count what it streamed), and never loads a model. Two uses:

* the load generator's fault tests: a request picks a fault with the first token of its
  prompt (``fault_token("stall")``; for chat the first word ``t<id>``), see :data:`FAULTS`;
* the client capacity benchmark (``experiments/loadgen_capacity``): with no delays the stub
  streams as fast as the client reads.

It is a raw :class:`asyncio.Protocol` speaking HTTP/1.1 (keep-alive, chunked responses, one
SSE event per HTTP chunk), not a web framework: a stream's events are built once per
request shape and cached, so a token costs the stub one ``transport.write`` (or less, with
``chunks_per_write``) and the stub stays out of the way of the client it measures.

Loopback only. ``python -m autotune.testing.stub_server --port 8100 --duration 60`` runs one in
the foreground for a bounded time; :class:`StubServer` runs one on a background thread.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Self

import msgspec

from autotune.testing._stub_faults import (
    _REQ_DECODER,
    StubConfig,
    _Counters,
    _fault_of,
    _health_status,
    _prompt_len,
    _Req,
)
from autotune.testing._stub_faults import FAULT_TOKEN_BASE as FAULT_TOKEN_BASE

# Re-exported: the fault lab's fake vLLM and the tests reach these through this module.
from autotune.testing._stub_faults import FAULTS as FAULTS
from autotune.testing._stub_faults import fault_token as fault_token
from autotune.testing._stub_wire import _MAX_BODY, _MAX_HEAD, _SSE_HEAD, _error, _plan, _response
from autotune.testing._stub_wire import _chunk as _chunk

logger = logging.getLogger(__name__)


@dataclass
class _App:
    """What all connections of one stub share: its config and the counters /metrics shows."""

    config: StubConfig
    counters: _Counters = field(default_factory=_Counters)
    started: float = field(default_factory=time.time)
    connections: set[_Conn] = field(default_factory=set)
    slots: asyncio.Semaphore | None = None  # max_running > 0: created on the serving loop

    def slot(self) -> asyncio.Semaphore | None:
        if self.config.max_running > 0 and self.slots is None:
            self.slots = asyncio.Semaphore(self.config.max_running)
        return self.slots

    def models(self) -> bytes:
        body = {
            "object": "list",
            "data": [
                {
                    "id": self.config.model,
                    "object": "model",
                    "created": int(self.started),
                    "owned_by": "autotune-stub",
                    "root": self.config.model,
                    "max_model_len": 1 << 20,
                }
            ],
        }
        return msgspec.json.encode(body)

    def metrics(self) -> bytes:
        c = self.counters
        lab = f'{{engine="0",model_name="{self.config.model}"}}'
        lines = [
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{lab} {c.generation_tokens}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{lab} {c.prompt_tokens}",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{lab[:-1]},finished_reason="length"}} {c.requests_success}',
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{lab} 0",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{lab} {c.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{lab} {c.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{lab} {min(1.0, c.running / 1024):.6f}",
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_bucket{lab[:-1]},le="+Inf"}} {c.ttft_count}',
            f"vllm:time_to_first_token_seconds_count{lab} {c.ttft_count}",
            f"vllm:time_to_first_token_seconds_sum{lab} {c.ttft_sum}",
        ]
        if self.config.tokens_per_chunk > 1:
            lines += [
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f"vllm:spec_decode_num_drafts_total{lab} {c.drafts}",
                "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
                f"vllm:spec_decode_num_draft_tokens_total{lab} {c.draft_tokens}",
                "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                f"vllm:spec_decode_num_accepted_tokens_total{lab} {c.accepted_tokens}",
            ]
        return ("\n".join(lines) + "\n").encode()


class _Gone(Exception):
    """The client's connection closed while a response was being written."""


class _Conn(asyncio.Protocol):
    """One client connection: parses requests one after another, answers each in turn."""

    def __init__(self, app: _App) -> None:
        self.app = app
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a response is being written; later requests wait in buf
        self.closed = False
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    # asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.app.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.app.connections.discard(self)
        self._wake()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # a stalled or slow stream has no one left to talk to

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake()

    # ------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        w, self.waiter = self.waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    async def _drain(self) -> None:
        if self.closed:
            raise _Gone
        if self.paused:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            if self.closed:
                raise _Gone

    def _send(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise _Gone
        self.transport.write(data)

    def _next(self) -> None:
        """Parse and answer the requests waiting in the buffer, until one needs to stream."""
        while not self.busy and not self.closed:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self._finish(_error(431, "request head too large", close=True), False)
                return
            try:
                lines = self.buf[:end].decode("latin-1").split("\r\n")
                method, target, version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._finish(_error(400, "malformed HTTP request", close=True), False)
                return
            if "chunked" in headers.get("transfer-encoding", "").lower():
                msg = "chunked request bodies are not supported"
                self._finish(_error(501, msg, close=True), False)
                return
            if length > _MAX_BODY:
                self._finish(_error(413, "request body too large", close=True), False)
                return
            if len(self.buf) < end + 4 + length:
                return  # the body is still on its way
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            conn = headers.get("connection", "").lower()
            keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
            self.busy = True
            self._route(method, target.split("?", 1)[0], body, keep)

    def _finish(self, data: bytes | None, keep: bool) -> None:
        if data is not None and not self.closed and self.transport is not None:
            self.transport.write(data)
        self.busy = False
        if not keep:
            if self.transport is not None:
                self.transport.close()
            self.closed = True

    def _route(self, method: str, path: str, body: bytes, keep: bool) -> None:
        app = self.app
        gets = {
            "/health": lambda: _response(_health_status(), b"", "text/plain"),
            "/v1/models": lambda: _response(200, app.models(), "application/json"),
            "/metrics": lambda: _response(200, app.metrics(), "text/plain; version=0.0.4"),
        }
        posts = {"/v1/completions": False, "/v1/chat/completions": True}
        if path in gets:
            if method != "GET":
                self._finish(_error(405, f"{method} {path} is not allowed"), keep)
            else:
                self._finish(gets[path](), keep)
        elif path in posts:
            if method != "POST":
                self._finish(_error(405, f"{method} {path} is not allowed"), keep)
                return
            arrived = time.monotonic()
            try:
                req = _REQ_DECODER.decode(body)
            except msgspec.DecodeError as exc:
                self._finish(_error(400, f"invalid request body: {exc}"), keep)
                return
            self.task = asyncio.get_running_loop().create_task(
                self._stream(req, chat=posts[path], arrived=arrived, keep=keep)
            )
        else:
            self._finish(_error(404, f"no route {path}"), keep)

    async def _stream(self, req: _Req, *, chat: bool, arrived: float, keep: bool) -> None:
        cfg = self.app.config
        c = self.app.counters
        fault = _fault_of(req)
        if fault in ("http_400", "http_500"):
            status = 400 if fault == "http_400" else 500
            self._finish(_error(status, f"stub: {fault} fault requested"), keep)
            self._resume()
            return
        if not req.stream:
            self._finish(_error(400, "stub: only stream=true is implemented"), keep)
            self._resume()
            return
        n_out = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        n_prompt = _prompt_len(req)
        opts = req.stream_options or {}
        include_usage = bool(opts.get("include_usage")) and fault != "no_usage"
        role, writes, tail = _plan(
            chat=chat,
            model=req.model or cfg.model,
            n_prompt=n_prompt,
            n_out=16 if n_out is None else max(0, n_out),
            k=max(1, cfg.tokens_per_chunk),
            per_write=max(1, cfg.chunks_per_write),
            fault=fault,
            include_usage=include_usage,
            continuous=include_usage and bool(opts.get("continuous_usage_stats")),
        )
        interval = cfg.slow_interval_s if fault == "slow" else cfg.chunk_interval_s
        loop = asyncio.get_running_loop()
        due = 0.0  # when the next write is due: paced on a clock, so pauses do not add up
        slots = self.app.slot()
        if slots is not None:
            c.waiting += 1
            try:
                await slots.acquire()
            finally:
                c.waiting -= 1
            if self.closed:  # the client left while queued: vLLM aborts such a request too
                slots.release()
                return
        c.running += 1
        c.prompt_tokens += n_prompt
        try:
            self._send(_SSE_HEAD if role is None else _SSE_HEAD + role)
            if cfg.ttft_s > 0:
                await asyncio.sleep(cfg.ttft_s)
            first = True
            for w in writes:
                self._send(w.data)
                c.generation_tokens += w.tokens
                if w.drafts:
                    c.drafts += w.drafts
                    c.draft_tokens += w.draft_tokens
                    c.accepted_tokens += w.accepted
                if first:
                    first = False
                    c.ttft_sum += time.monotonic() - arrived
                    c.ttft_count += 1
                if w.then == "disconnect":
                    if self.transport is not None:
                        self.transport.abort()
                    return
                if w.then == "end":  # vLLM's in-stream error: [DONE] and nothing more
                    self._send(tail)
                    self._finish(None, keep)
                    self._resume()
                    return
                if w.then == "stall":
                    await asyncio.sleep(cfg.stall_s)
                    due = 0.0
                if interval > 0:
                    due = (due or loop.time()) + interval
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    if self.paused:
                        await self._drain()
                elif self.paused:
                    await self._drain()
                elif cfg.interleave:
                    await asyncio.sleep(0)
            self._send(tail)
            c.requests_success += 1
            self._finish(None, keep)
            self._resume()
        except (_Gone, asyncio.CancelledError):
            pass  # the client went away (its timeout, or our own disconnect fault)
        finally:
            c.running -= 1
            if slots is not None:
                slots.release()

    def _resume(self) -> None:
        if not self.busy and not self.closed and self.buf:
            self._next()


@dataclass(frozen=True, slots=True)
class Running:
    """A stub serving on an event loop: its listening server and what it counted."""

    server: asyncio.Server
    app: _App

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    def close(self) -> None:
        """Stop listening and drop every open connection (their streams end)."""
        self.server.close()
        for conn in list(self.app.connections):
            if conn.transport is not None:
                conn.transport.abort()


async def start_server(
    config: StubConfig, *, sock: socket.socket | None = None, port: int = 0
) -> Running:
    """Start serving on ``sock`` (a bound socket) or on 127.0.0.1:``port``."""
    app = _App(config)
    loop = asyncio.get_running_loop()
    if sock is None:
        server = await loop.create_server(
            lambda: _Conn(app), "127.0.0.1", port, backlog=4096, reuse_address=True
        )
    else:
        server = await loop.create_server(lambda: _Conn(app), sock=sock, backlog=4096)
    return Running(server, app)


class StubServer:
    """Run the stub on a background thread (its own event loop) on 127.0.0.1.

    Use as a context manager; ``base_url`` is valid inside it. ``port=0`` picks a free port.
    """

    def __init__(self, config: StubConfig | None = None, *, port: int = 0) -> None:
        self.config = config or StubConfig()
        self._port = port
        self._app: _App | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def generation_tokens(self) -> int:
        """Tokens streamed so far (what ``/metrics`` reports)."""
        return self._app.counters.generation_tokens if self._app is not None else 0

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stub-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("stub server did not start within 10 s")
        if self._error is not None:
            raise RuntimeError(f"stub server failed to start: {self._error}") from self._error

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            running = loop.run_until_complete(start_server(self.config, port=self._port))
        except OSError as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._app = running.app
        self.port = running.port
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            running.close()
            # Streams of stalled or slow requests may still sleep: cancel and reap them.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            with contextlib.suppress(Exception):
                loop.run_until_complete(running.server.wait_closed())
            loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop = None
        self._thread = None


async def serve(
    config: StubConfig, *, port: int, duration_s: float, reuse_port: bool = False
) -> None:
    """Serve on 127.0.0.1:``port`` for ``duration_s`` seconds, then stop.

    ``reuse_port``: bind with ``SO_REUSEPORT``, so several stub processes share the port and
    the kernel spreads connections over them (a stub on more than one core).
    """
    sock = None
    if reuse_port:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
    running = await start_server(config, sock=sock, port=port)
    logger.info("stub serving %s on 127.0.0.1:%d for %.0f s", config.model, port, duration_s)
    try:
        await asyncio.sleep(duration_s)
    finally:
        running.close()


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--duration", type=float, default=60.0, help="seconds before it exits")
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--chunks-per-write", type=int, default=1)
    p.add_argument("--chunk-interval", type=float, default=0.0)
    p.add_argument("--ttft", type=float, default=0.0)
    p.add_argument("--max-running", type=int, default=0,
                   help="requests streamed at once (the rest queue); 0 = no limit")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="yield to other streams after every write, as an engine step serves every "
        "running request once (the hardest case for a client: about one event per read)",
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT so several stub processes can share the port",
    )
    p.add_argument("--uvloop", action="store_true", help="serve on uvloop")
    a = p.parse_args(argv)
    cfg = StubConfig(
        model=a.model,
        tokens_per_chunk=a.tokens_per_chunk,
        chunks_per_write=a.chunks_per_write,
        chunk_interval_s=a.chunk_interval,
        ttft_s=a.ttft,
        interleave=a.interleave,
        max_running=a.max_running,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    coro = serve(cfg, port=a.port, duration_s=a.duration, reuse_port=a.reuse_port)
    if a.uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(coro)
    else:
        asyncio.run(coro)


if __name__ == "__main__":
    _main()
