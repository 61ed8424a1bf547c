"""Request bodies and the streamed (SSE) response parser of the load generator.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec

from autotune.load._http1 import RequestFailure, short

if TYPE_CHECKING:

    from autotune.traffic import RequestSpec
from autotune.load._records import _STREAM_OPTIONS, Api

logger = logging.getLogger(__name__)


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct, gc=False):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's new tokens


class _Chunk(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: object = None  # any JSON: only reported


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


_encode = msgspec.json.Encoder().encode


def _body(spec: RequestSpec, model: str, api: Api, *, token_ids: bool = False) -> bytes:
    """The request's JSON; ``token_ids`` asks the server for the generated token ids
    (vLLM's ``return_token_ids``: a session's next turn extends its prompt with them)."""
    if api == "completions":
        payload: dict[str, object] = {"model": model, "prompt": list(spec.prompt_token_ids)}
        payload["max_tokens"] = spec.max_tokens
        if token_ids:
            payload["return_token_ids"] = True
    else:
        text = spec.prompt
        if text is None:  # the tiny models' words: token i is "t<i>"
            text = " ".join(f"t{i}" for i in spec.prompt_token_ids)
        payload = {"model": model, "messages": [{"role": "user", "content": text}]}
        # both names: OpenAI's current one and the older one some servers still read
        payload["max_tokens"] = payload["max_completion_tokens"] = spec.max_tokens
    payload.update(
        stream=True,
        stream_options=_STREAM_OPTIONS,
        ignore_eos=True,
        temperature=0,
    )
    return _encode(payload)


_SSE_FIELDS = (b"event:", b"id:", b"retry:", b":")


class _SseParser:
    """Incremental parser of one streamed response (the hot path: keep it lean).

    ``feed`` takes whatever bytes one socket read returned and the time they arrived;
    every chunk that carried tokens adds (time, tokens). Token counts come from the
    cumulative ``usage.completion_tokens`` of continuous usage stats when the server sends
    them, else one per chunk with text. Raises :class:`~autotune._http1.RequestFailure` on
    malformed SSE or an in-stream error object.
    """

    __slots__ = ("chat", "cum", "done", "ids", "prompt_tokens", "tail", "times", "tokens",
                 "usage_total")

    def __init__(self, *, chat: bool, ids: list[int] | None = None) -> None:
        self.chat = chat
        self.ids = ids  # collects the generated token ids the server returns, when given
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.prompt_tokens: int | None = None
        self.usage_total: int | None = None
        self.cum = 0
        self.done = False
        self.tail = b""

    def feed(self, data: bytes, now: float) -> None:
        if self.tail:
            data = self.tail + data
        lines = data.split(b"\n")
        self.tail = lines.pop()
        for line in lines:
            if not line:
                continue
            if line[:6] == b"data: ":
                payload = line[6:]
            elif line[:5] == b"data:":
                payload = line[5:]
            else:
                if line == b"\r" or line.startswith(_SSE_FIELDS):
                    continue
                raise RequestFailure("malformed_sse", short(f"not an SSE line: {line[:120]!r}"))
            if payload[:1] != b"{" and payload.strip() == b"[DONE]":
                self.done = True
                continue
            try:
                chunk = _decode_chunk(payload)
            except msgspec.DecodeError as exc:
                raise RequestFailure(
                    "malformed_sse", short(f"{exc}; event: {payload[:120]!r}")
                ) from None
            if chunk.error is not None:
                raise RequestFailure("server_error", short(f"in-stream error: {chunk.error}"))
            usage = chunk.usage
            if usage is not None:
                if usage.prompt_tokens is not None:
                    self.prompt_tokens = usage.prompt_tokens
                if usage.completion_tokens is not None:
                    self.usage_total = usage.completion_tokens
            choices = chunk.choices
            if not choices:
                continue
            if self.ids is not None and choices[0].token_ids:
                self.ids.extend(choices[0].token_ids)
            if usage is not None and usage.completion_tokens is not None:
                n = usage.completion_tokens - self.cum
                self.cum = usage.completion_tokens
            else:
                c0 = choices[0]
                n = 0
                if self.chat:
                    d = c0.delta
                    if d is not None and (d.content or d.reasoning_content):
                        n = 1
                elif c0.text or c0.finish_reason is None:
                    n = 1
                self.cum += n
            if n > 0:
                self.times.append(now)
                self.tokens.append(n)

    def close(self) -> None:
        """The body ended cleanly: check it ended as a complete stream."""
        if self.tail.strip():
            raise RequestFailure("malformed_sse", short(f"unterminated line at end: {self.tail!r}"))
        if not self.done:
            raise RequestFailure("disconnected", "the stream ended before data: [DONE]")
