"""A lean HTTP/1.1 client for streamed responses: the load generator's wire.

Why not aiohttp: against a server that streams one SSE event per HTTP chunk (vLLM does,
one per engine step and request), a socket read usually holds one event, and aiohttp spends
about 15 us of Python per HTTP chunk (its protocol, chunk bookkeeping, ``StreamReader`` and
a task wake-up) before the caller sees a byte: one core then tops out near 45,000 streamed
tokens/s at 1,024 streams (``experiments/loadgen_capacity``). Here each socket read is one
:meth:`asyncio.Protocol.data_received` call that strips the chunk framing and hands the
payload, with the time it arrived, straight to a sink (the SSE parser): no stream object,
no future, no task switch per read.

What it speaks: ``POST`` with a ``Content-Length`` body; keep-alive connections (a
:class:`Pool` reuses idle ones); responses framed by ``Transfer-Encoding: chunked``,
``Content-Length`` or the end of the connection; ``1xx`` responses skipped; ``http://`` and
``https://``. No redirects, proxies, compression or pipelining: a load generator does not
need them. Every failure is a :class:`RequestFailure` with a reason class of
:data:`autotune.load.ERROR_REASONS`.
"""

from __future__ import annotations

import asyncio
import errno
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["Pool", "RequestFailure", "Target"]

_MAX_HEAD = 64 * 1024  # response head
_MAX_SIZE_LINE = 1024  # one chunk-size line
_MAX_ERROR_BODY = 64 * 1024  # kept of a non-200 body
_DETAIL_MAX = 300

Sink = Callable[[bytes, float], None]  # (payload bytes, arrival time in run seconds)


def short(text: str) -> str:
    """One line of at most 300 characters, for a record's ``detail``."""
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 3] + "..."


class RequestFailure(Exception):
    """Ends one request with a reason class (``autotune.load.ERROR_REASONS``)."""

    def __init__(self, reason: str, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.status = status  # the response's status when its head had arrived


class _Stale(Exception):
    """A reused keep-alive connection closed before any byte of the response arrived."""


class Target:
    """Where requests go: scheme, host, port and the request head's fixed part."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http:// or https:// URL")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None
        )
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        default = (parts.scheme == "https" and self.port == 443) or self.port == 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = host if default else f"{host}:{self.port}"

    def post_head(self, path: str, length: int, headers: dict[str, str]) -> bytes:
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.authority}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append(f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# body framing of the response being read
_HEAD, _CHUNKED, _LENGTH, _UNTIL_CLOSE, _TRAILER = range(5)


class _Conn(asyncio.Protocol):
    """One keep-alive connection; reads one response at a time into the request's sink."""

    def __init__(self, clock: Callable[[], float], t0: float) -> None:
        self.clock = clock
        self.t0 = t0
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.fut: asyncio.Future[int] | None = None  # the response in flight: its status
        self.state = _HEAD
        self.buf = b""  # head bytes, or a partial chunk-size line
        self.rem = 0  # chunk or body bytes still to come
        self.crlf = 0  # bytes of the CRLF after a chunk's data still to skip
        self.status = 0
        self.keep = True
        self.got_bytes = False
        self.last_rx = 0.0  # monotonic time of the last read
        self.sink: Sink | None = None
        self.error_body: list[bytes] = []
        self.error_len = 0
        self.timers: list[asyncio.TimerHandle] = []

    # --- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.fut is None or self.fut.done():
            return
        if self.state == _UNTIL_CLOSE and exc is None:
            self._complete()
        elif not self.got_bytes and self.reused:
            self._fail(_Stale())
        else:
            where = "before the response" if not self.got_bytes else "mid-response"
            why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
            self._fail(RequestFailure("disconnected", short(f"connection closed {where}{why}")))

    def data_received(self, data: bytes) -> None:
        now = self.clock()
        self.last_rx = now
        self.got_bytes = True
        if self.fut is None or self.fut.done():
            self.keep = False  # bytes nobody asked for: do not reuse this connection
            return
        try:
            if self.state == _CHUNKED:
                self._chunked(data, now - self.t0)
            elif self.state == _HEAD:
                self._head(data, now - self.t0)
            elif self.state == _LENGTH:
                self._length(data, now - self.t0)
            elif self.state == _UNTIL_CLOSE:
                self._emit(data, now - self.t0)
            else:
                self._trailer(data)
        except RequestFailure as f:
            self._fail(f)

    # --- one exchange --------------------------------------------------------------------------

    reused = False

    async def exchange(
        self,
        request: bytes,
        sink: Sink,
        *,
        timeout_s: float,
        stall_s: float,
        reused: bool,
    ) -> int:
        """Send ``request``; stream the body of a 200 into ``sink``; return the status.

        A non-200 response's body is read whole and raised as a :class:`RequestFailure`.
        """
        loop = asyncio.get_running_loop()
        self.fut = loop.create_future()
        self.state, self.buf, self.rem, self.crlf, self.status = _HEAD, b"", 0, 0, 0
        self.keep, self.got_bytes, self.reused = True, False, reused
        self.sink = sink
        self.error_body, self.error_len = [], 0
        self.last_rx = self.clock()
        self.timers = [
            loop.call_later(timeout_s, self._timeout, timeout_s),
            loop.call_later(stall_s, self._check_stall, stall_s),
        ]
        try:
            if self.closed or self.transport is None:
                raise _Stale() if reused else RequestFailure("disconnected", "connection closed")
            self.transport.write(request)
            return await self.fut
        except RequestFailure as f:
            if f.status is None and self.status:
                f.status = self.status
            raise
        except asyncio.CancelledError:
            self.keep = False  # the response may still be arriving: never reuse this one
            raise
        finally:
            for t in self.timers:
                t.cancel()
            self.sink = None

    @property
    def reusable(self) -> bool:
        return not self.closed and self.keep and self.fut is not None and self.fut.done()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        self.keep = False
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(exc)
        self.abort()

    def _timeout(self, timeout_s: float) -> None:
        self._fail(RequestFailure("timeout", f"the request took longer than {timeout_s:g} s"))

    def _check_stall(self, stall_s: float) -> None:
        if self.fut is None or self.fut.done():
            return
        idle = self.clock() - self.last_rx
        if idle >= stall_s:
            what = "the response head" if self.state == _HEAD else "the next bytes"
            self._fail(RequestFailure("stalled", f"no bytes for {stall_s:g} s waiting for {what}"))
        else:
            loop = asyncio.get_running_loop()
            self.timers.append(loop.call_later(stall_s - idle, self._check_stall, stall_s))

    def _complete(self) -> None:
        if self.fut is None or self.fut.done():
            return
        if self.status != 200:
            text = b"".join(self.error_body).decode("utf-8", "replace")
            kind = self.status // 100
            reason = "http_4xx" if kind == 4 else "http_5xx" if kind == 5 else "http_other"
            self.fut.set_exception(RequestFailure(reason, short(f"HTTP {self.status}: {text}")))
        else:
            self.fut.set_result(self.status)

    def _emit(self, data: bytes, now: float) -> None:
        if self.status == 200:
            self.sink(data, now)  # type: ignore[misc]
        elif self.error_len < _MAX_ERROR_BODY:
            self.error_body.append(data)
            self.error_len += len(data)

    # --- parsing -------------------------------------------------------------------------------

    def _head(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD:
                raise RequestFailure("client_error", "response head larger than 64 KiB")
            self.buf = buf
            return
        self.buf = b""
        lines = buf[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise RequestFailure("client_error", short(f"not an HTTP/1.x response: {lines[0]!r}"))
        status = int(parts[1])
        rest = buf[end + 4 :]
        if 100 <= status < 200:  # 100 Continue and friends: the real head follows
            if rest:
                self._head(rest, now)
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.status = status
        conn = headers.get("connection", "").lower()
        self.keep = conn != "close" if parts[0] == "HTTP/1.1" else conn == "keep-alive"
        if status in (204, 304):  # no body, whatever the headers say
            self._complete()
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNKED
            if rest:
                self._chunked(rest, now)
        elif "content-length" in headers:
            try:
                self.rem = int(headers["content-length"])
            except ValueError:
                raise RequestFailure(
                    "client_error", short(f"bad Content-Length: {headers['content-length']!r}")
                ) from None
            self.state = _LENGTH
            if self.rem == 0:
                self._complete()
            elif rest:
                self._length(rest, now)
        else:
            self.state = _UNTIL_CLOSE
            self.keep = False
            if rest:
                self._emit(rest, now)

    def _length(self, data: bytes, now: float) -> None:
        if len(data) > self.rem:
            data = data[: self.rem]
            self.keep = False  # more than the body: the connection is out of step
        self.rem -= len(data)
        self._emit(data, now)
        if self.rem == 0:
            self._complete()

    def _chunked(self, data: bytes, now: float) -> None:
        """Strip the chunk framing of one read and emit its payload as one piece."""
        if self.buf:
            data = self.buf + data
            self.buf = b""
        pos, n = 0, len(data)
        rem, crlf = self.rem, self.crlf
        pieces: list[bytes] = []
        while pos < n:
            if rem:
                end = pos + rem
                if end + 2 <= n and data[end : end + 2] == b"\r\n":  # the usual case
                    pieces.append(data[pos:end])
                    pos, rem = end + 2, 0
                elif end <= n:
                    pieces.append(data[pos:end])
                    pos, rem, crlf = end, 0, 2
                else:
                    pieces.append(data[pos:])
                    rem, pos = end - n, n
            elif crlf:
                take = min(crlf, n - pos)
                if data[pos : pos + take] != b"\r\n"[2 - crlf : 2 - crlf + take]:
                    raise RequestFailure("client_error", "chunk data not followed by CRLF")
                pos += take
                crlf -= take
            else:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > _MAX_SIZE_LINE:
                        raise RequestFailure("client_error", "chunk-size line too long")
                    self.buf = data[pos:]
                    break
                line = data[pos:eol]
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise RequestFailure(
                        "client_error", short(f"bad chunk-size line: {line[:80]!r}")
                    ) from None
                pos = eol + 2
                if size == 0:  # the last chunk: trailers (usually none) end the body
                    self.rem, self.crlf = 0, 0
                    if pieces:
                        self._emit(b"".join(pieces) if len(pieces) > 1 else pieces[0], now)
                    self.state = _TRAILER
                    self._trailer(data[pos:])
                    return
                rem = size
        self.rem, self.crlf = rem, crlf
        if pieces:
            self._emit(b"".join(pieces) if len(pieces) > 1 else pieces[0], now)

    def _trailer(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                if len(buf) > _MAX_HEAD:
                    raise RequestFailure("client_error", "trailer larger than 64 KiB")
                self.buf = buf
                return
            line, buf = buf[:eol], buf[eol + 2 :]
            if not line:  # the empty line: the response is complete
                self.buf = b""
                if buf:
                    self.keep = False
                self._complete()
                return


class Pool:
    """Keep-alive connections to one :class:`Target`; opens more as concurrency needs."""

    def __init__(self, target: Target, *, t0: float, clock: Callable[[], float] = time.monotonic):
        self.target = target
        self.t0 = t0
        self.clock = clock
        self.idle: list[_Conn] = []
        self.opened = 0

    async def _open(self) -> _Conn:
        loop = asyncio.get_running_loop()
        t = self.target
        try:
            _, conn = await loop.create_connection(
                lambda: _Conn(self.clock, self.t0), t.host, t.port, ssl=t.ssl
            )
        except ConnectionRefusedError as exc:
            raise RequestFailure("connection_refused", short(f"{t.authority}: {exc}")) from None
        except OSError as exc:
            reason = "connection_refused" if exc.errno == errno.ECONNREFUSED else "connect_error"
            raise RequestFailure(reason, short(f"{t.authority}: {exc}")) from None
        self.opened += 1
        return conn

    async def request(self, request: bytes, sink: Sink, *, timeout_s: float, stall_s: float) -> int:
        """One exchange on an idle connection (or a new one). Returns the status (200)."""
        deadline = self.clock() + timeout_s
        while self.idle:
            conn = self.idle.pop()
            if not conn.reusable:  # closed by the server, or sent bytes nobody asked for
                conn.abort()
                continue
            try:
                status = await conn.exchange(
                    request, sink, timeout_s=timeout_s, stall_s=stall_s, reused=True
                )
            except _Stale:
                continue  # the server closed it while idle: nothing was sent to it
            finally:
                self._release(conn)
            return status
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
            # cancellation (Ctrl-C) that lands as the connection completes
            async with asyncio.timeout(max(0.0, deadline - self.clock())):
                conn = await self._open()
        except TimeoutError:
            raise RequestFailure(
                "timeout", f"no connection within the request's {timeout_s:g} s"
            ) from None
        try:
            status = await conn.exchange(
                request,
                sink,
                timeout_s=max(0.0, deadline - self.clock()),
                stall_s=stall_s,
                reused=False,
            )
        except _Stale:  # cannot happen on a fresh connection; keep the contract anyway
            raise RequestFailure("disconnected", "connection closed before the response") from None
        finally:
            self._release(conn)
        return status

    def _release(self, conn: _Conn) -> None:
        if conn.reusable:
            self.idle.append(conn)
        else:
            conn.abort()

    def close(self) -> None:
        """Close the idle connections (requests in flight end on their own)."""
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()
