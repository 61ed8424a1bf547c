"""The stub server's HTTP wire: status lines, chunked and SSE bodies, and the plan of a
streamed response.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import msgspec

logger = logging.getLogger(__name__)


_STATUS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
}


_MAX_HEAD = 64 * 1024


_MAX_BODY = 64 * 1024 * 1024


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


_LAST_CHUNK = b"0\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: int, body: bytes, content_type: str, *, close: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_STATUS.get(status, 'Unknown')}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    )
    return head.encode("latin-1") + body


def _error(status: int, message: str, *, close: bool = False) -> bytes:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    body = {"error": {"object": "error", "message": message, "type": kind, "code": status}}
    return _response(status, msgspec.json.encode(body), "application/json", close=close)


@dataclass(frozen=True, slots=True)
class _Write:
    data: bytes  # HTTP chunks, already framed
    tokens: int  # output tokens in them
    drafts: int  # speculative-decoding counters the stub's /metrics reports
    draft_tokens: int
    accepted: int
    then: str | None = None  # "disconnect", "stall" or "end" (error_event: stream ends here)


@functools.lru_cache(maxsize=512)
def _plan(
    *,
    chat: bool,
    model: str,
    n_prompt: int,
    n_out: int,
    k: int,
    per_write: int,
    fault: str,
    include_usage: bool,
    continuous: bool,
) -> tuple[bytes | None, tuple[_Write, ...], bytes]:
    """(role event or None, the token writes, the tail: usage event, [DONE], last chunk)."""
    base = (
        b'data: {"id":"'
        + (b"chatcmpl-stub" if chat else b"cmpl-stub")
        + b'","object":"'
        + (b"chat.completion.chunk" if chat else b"text_completion")
        + b'","created":0,"model":"'
        + model.encode()
        + b'"'
    )
    head = base + (b',"choices":[{"index":0,"delta":' if chat else b',"choices":[{"index":0,')
    usage_tpl = b',"usage":{"prompt_tokens":%d,"total_tokens":%%d,"completion_tokens":%%d}' % (
        n_prompt
    )

    def event(text: bytes, finish: bytes, done_tokens: int) -> bytes:
        if chat:
            body = head + b'{"content":"' + text + b'"},"logprobs":null,"finish_reason":' + finish
            body += b"}]"
        else:
            body = head + b'"text":"' + text + b'","logprobs":null,"finish_reason":' + finish
            body += b',"stop_reason":null}]'
        if continuous:
            body += usage_tpl % (n_prompt + done_tokens, done_tokens)
        return _chunk(body + b"}\n\n")

    role = None
    if chat:
        body = head + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
        if continuous:
            body += usage_tpl % (n_prompt, 0)
        role = _chunk(body + b"}\n\n")
    writes: list[_Write] = []
    batch: list[bytes] = []
    counts = [0, 0, 0, 0]  # tokens, drafts, draft tokens, accepted tokens of the batch
    done = n_chunks = 0
    while done < n_out:
        step = min(k, n_out - done)
        done += step
        batch.append(event(b" t7" * step, b'"length"' if done >= n_out else b"null", done))
        n_chunks += 1
        counts[0] += step
        if k > 1:
            counts[1] += 1
            counts[2] += k - 1
            counts[3] += step - 1
        then = None
        if n_chunks == 2 and fault == "malformed":
            batch.append(_chunk(b'data: {"choices": [{"index": 0, "text": \n\n'))
        elif n_chunks == 2 and fault == "garbage":
            batch.append(_chunk(b"this is not server-sent events\n\n"))
        elif n_chunks == 2 and fault == "error_event":
            batch.append(
                _chunk(
                    b'data: {"error": {"object": "error", "message": "stub: engine died",'
                    b' "type": "InternalServerError", "code": 500}}\n\n'
                )
            )
            then = "end"
        if len(batch) >= per_write or done >= n_out or then:
            if then is None and n_chunks >= 2 and fault in ("disconnect", "stall"):
                then = fault
            writes.append(_Write(b"".join(batch), counts[0], counts[1], counts[2], counts[3],
                                 then=then))
            batch.clear()
            counts = [0, 0, 0, 0]
            if then == "end":
                return role, tuple(writes), _chunk(b"data: [DONE]\n\n") + _LAST_CHUNK
            if then == "stall":
                fault = "ok"  # silent once, then streams on
            elif then == "disconnect":
                break
    tail = b""
    if include_usage:
        tail += _chunk(base + b',"choices":[]' + usage_tpl % (n_prompt + done, done) + b"}\n\n")
    if fault != "no_done":
        tail += _chunk(b"data: [DONE]\n\n")
    return role, tuple(writes), tail + _LAST_CHUNK
