"""A fast OpenAI-compatible streaming stub server that can misbehave on purpose.

It streams canned tokens in vLLM's SSE format for ``/v1/completions`` and
``/v1/chat/completions``, answers ``/v1/models``, ``/health`` and ``/metrics`` (a few
``vllm:`` series that count what it streamed), and never loads a model. Two uses:

* the load generator's fault tests: a request picks a fault with the first token of its
  prompt (``fault_token("stall")``; for chat the first word ``t<id>``), see :data:`FAULTS`;
* the client capacity benchmark (``experiments/loadgen_capacity``): with no delays the stub
  streams as fast as the client reads.

Loopback only. ``python -m autotune._stub_server --port 8100 --duration 60`` runs one in
the foreground for a bounded time; :class:`StubServer` runs one on a background thread.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Self

import msgspec
from aiohttp import web

__all__ = ["FAULTS", "FAULT_TOKEN_BASE", "StubConfig", "StubServer", "fault_token", "serve"]

logger = logging.getLogger(__name__)

#: Faults a request can ask for. ``ok`` is normal; ``http_400``/``http_500`` answer with an
#: error status; ``disconnect`` drops the connection mid-stream; ``stall`` goes silent after
#: two chunks for ``StubConfig.stall_s``; ``slow`` streams a chunk every ``slow_interval_s``
#: (never stalls, but is slow overall); ``malformed`` sends a broken JSON event;
#: ``garbage`` sends a line that is not SSE; ``error_event`` sends vLLM's in-stream error
#: object; ``no_done`` ends the stream cleanly without ``data: [DONE]``; ``no_usage``
#: streams without any ``usage`` (a server without continuous usage stats).
FAULTS: tuple[str, ...] = (
    "ok",
    "http_400",
    "http_500",
    "disconnect",
    "stall",
    "slow",
    "malformed",
    "garbage",
    "error_event",
    "no_done",
    "no_usage",
)
FAULT_TOKEN_BASE = 900_000


def fault_token(name: str) -> int:
    """The prompt token id that makes the stub apply fault ``name`` to that request."""
    try:
        return FAULT_TOKEN_BASE + FAULTS.index(name)
    except ValueError:
        raise ValueError(f"unknown stub fault {name!r}; choose one of {FAULTS}") from None


@dataclass(frozen=True, slots=True)
class StubConfig:
    """How the stub streams. Zero delays mean "as fast as the client reads"."""

    model: str = "tiny"
    tokens_per_chunk: int = 1  # >1 emulates speculative decoding (several tokens a chunk)
    chunks_per_write: int = 1  # SSE events coalesced into one socket write
    chunk_interval_s: float = 0.0  # pause between writes
    ttft_s: float = 0.0  # pause before the first token
    stall_s: float = 30.0  # how long a "stall" fault stays silent
    slow_interval_s: float = 0.05  # chunk interval of the "slow" fault


@dataclass
class _Counters:
    generation_tokens: int = 0
    prompt_tokens: int = 0
    requests_success: int = 0
    running: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class _Msg(msgspec.Struct):
    content: str | None = None


class _Req(msgspec.Struct):
    model: str | None = None
    prompt: list[int] | str | None = None
    messages: list[_Msg] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


_REQ_DECODER = msgspec.json.Decoder(_Req)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _fault_of(req: _Req) -> str:
    first: int | None = None
    if isinstance(req.prompt, list) and req.prompt:
        first = req.prompt[0]
    elif req.messages:
        words = (req.messages[0].content or "").split(maxsplit=1)
        if words and words[0].startswith("t") and words[0][1:].isdigit():
            first = int(words[0][1:])
    if first is not None and FAULT_TOKEN_BASE <= first < FAULT_TOKEN_BASE + len(FAULTS):
        return FAULTS[first - FAULT_TOKEN_BASE]
    return "ok"


def _prompt_len(req: _Req) -> int:
    if isinstance(req.prompt, list):
        return len(req.prompt)
    if isinstance(req.prompt, str):
        return len(req.prompt.split())
    return sum(len((m.content or "").split()) for m in req.messages or ())


@dataclass
class _App:
    config: StubConfig
    counters: _Counters = field(default_factory=_Counters)
    started: float = field(default_factory=time.time)

    def build(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
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
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
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
            f"vllm:num_requests_waiting{lab} 0",
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
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=True)

    async def _stream(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            req = _REQ_DECODER.decode(await request.read())
        except msgspec.DecodeError as exc:
            return _error(400, f"invalid request body: {exc}")
        cfg = self.config
        fault = _fault_of(req)
        if fault == "http_400":
            return _error(400, "stub: http_400 fault requested")
        if fault == "http_500":
            return _error(500, "stub: http_500 fault requested")
        if not req.stream:
            return _error(400, "stub: only stream=true is implemented")
        n_out = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        n_out = 16 if n_out is None else max(0, n_out)
        n_prompt = _prompt_len(req)
        opts = req.stream_options or {}
        include_usage = bool(opts.get("include_usage")) and fault != "no_usage"
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        model = (req.model or cfg.model).encode()
        rid = f"{id(request):x}".encode()
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        base = (
            b'data: {"id":"'
            + (b"chatcmpl-" if chat else b"cmpl-")
            + rid
            + b'","object":"'
            + kind
            + b'","created":0,"model":"'
            + model
            + b'"'
        )
        head = base + (b',"choices":[{"index":0,"delta":' if chat else b',"choices":[{"index":0,')
        usage_tpl = b',"usage":{"prompt_tokens":%d,"total_tokens":%%d,"completion_tokens":%%d}' % (
            n_prompt
        )

        def event(text: bytes, finish: bytes, done_tokens: int) -> bytes:
            if chat:
                body = (
                    head
                    + b'{"content":"'
                    + text
                    + b'"},"logprobs":null,"finish_reason":'
                    + finish
                    + b"}]"
                )
            else:
                body = (
                    head
                    + b'"text":"'
                    + text
                    + b'","logprobs":null,"finish_reason":'
                    + finish
                    + b',"stop_reason":null}]'
                )
            if continuous:
                body += usage_tpl % (n_prompt + done_tokens, done_tokens)
            return body + b"}\n\n"

        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        await resp.prepare(request)
        c = self.counters
        c.running += 1
        c.prompt_tokens += n_prompt
        try:
            if chat:
                role = (
                    head
                    + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
                )
                if continuous:
                    role += usage_tpl % (n_prompt, 0)
                await resp.write(role + b"}\n\n")
            if cfg.ttft_s > 0:
                await asyncio.sleep(cfg.ttft_s)
            k = max(1, cfg.tokens_per_chunk)
            per_write = max(1, cfg.chunks_per_write)
            interval = cfg.slow_interval_s if fault == "slow" else cfg.chunk_interval_s
            done = 0
            n_chunks = 0
            batch: list[bytes] = []
            first = True
            while done < n_out:
                step = min(k, n_out - done)
                done += step
                text = b" t7" * step
                finish = b'"length"' if done >= n_out else b"null"
                batch.append(event(text, finish, done))
                n_chunks += 1
                c.generation_tokens += step
                if k > 1:
                    c.drafts += 1
                    c.draft_tokens += k - 1
                    c.accepted_tokens += step - 1
                if fault == "malformed" and n_chunks == 2:
                    batch.append(b'data: {"choices": [{"index": 0, "text": \n\n')
                if fault == "garbage" and n_chunks == 2:
                    batch.append(b"this is not server-sent events\n\n")
                if fault == "error_event" and n_chunks == 2:
                    batch.append(
                        b'data: {"error": {"object": "error", "message": "stub: engine died",'
                        b' "type": "InternalServerError", "code": 500}}\n\n'
                    )
                    await resp.write(b"".join(batch))
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                    return resp
                if len(batch) >= per_write or done >= n_out:
                    await resp.write(b"".join(batch) if len(batch) > 1 else batch[0])
                    batch.clear()
                    if first:
                        first = False
                        c.ttft_sum += time.monotonic() - arrived
                        c.ttft_count += 1
                    if fault == "disconnect" and n_chunks >= 2:
                        if request.transport is not None:
                            request.transport.abort()
                        return resp
                    if fault == "stall" and n_chunks >= 2:
                        await asyncio.sleep(cfg.stall_s)
                        fault = "ok"
                    if interval > 0:
                        await asyncio.sleep(interval)
            if include_usage:
                await resp.write(
                    base + b',"choices":[]' + usage_tpl % (n_prompt + done, done) + b"}\n\n"
                )
            if fault != "no_done":
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            c.requests_success += 1
        except ConnectionResetError:
            # The client went away (its timeout, or our own disconnect fault): nothing to do.
            pass
        finally:
            c.running -= 1
        return resp


def _error(status: int, message: str) -> web.Response:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    body = {"error": {"object": "error", "message": message, "type": kind, "code": status}}
    return web.Response(
        status=status, body=msgspec.json.encode(body), content_type="application/json"
    )


class StubServer:
    """Run the stub on a background thread (its own event loop) on 127.0.0.1.

    Use as a context manager; ``base_url`` is valid inside it. ``port=0`` picks a free port.
    """

    def __init__(self, config: StubConfig | None = None, *, port: int = 0) -> None:
        self.config = config or StubConfig()
        self._port = port
        self._app = _App(self.config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
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
        return self._app.counters.generation_tokens

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
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self._port))
            self.port = sock.getsockname()[1]
            runner = web.AppRunner(self._app.build(), access_log=None, shutdown_timeout=0.5)
            loop.run_until_complete(runner.setup())
            site = web.SockSite(runner, sock, backlog=4096)
            loop.run_until_complete(site.start())
            self._runner = runner
        except OSError as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        try:
            loop.run_until_complete(runner.cleanup())
        finally:
            # Handlers of stalled or slow streams may still sleep: cancel and reap them.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop = None
        self._thread = None


async def serve(config: StubConfig, *, port: int, duration_s: float) -> None:
    """Serve on 127.0.0.1:``port`` for ``duration_s`` seconds, then stop."""
    runner = web.AppRunner(_App(config).build(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    logger.info("stub serving %s on 127.0.0.1:%d for %.0f s", config.model, port, duration_s)
    try:
        await asyncio.sleep(duration_s)
    finally:
        await runner.cleanup()


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--duration", type=float, default=60.0, help="seconds before it exits")
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--chunks-per-write", type=int, default=1)
    p.add_argument("--chunk-interval", type=float, default=0.0)
    p.add_argument("--ttft", type=float, default=0.0)
    p.add_argument("--uvloop", action="store_true", help="serve on uvloop")
    a = p.parse_args(argv)
    cfg = StubConfig(
        model=a.model,
        tokens_per_chunk=a.tokens_per_chunk,
        chunks_per_write=a.chunks_per_write,
        chunk_interval_s=a.chunk_interval,
        ttft_s=a.ttft,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    coro = serve(cfg, port=a.port, duration_s=a.duration)
    if a.uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(coro)
    else:
        asyncio.run(coro)


if __name__ == "__main__":
    _main()
