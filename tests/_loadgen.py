"""Helpers shared by tests/integration/test_loadgen.py and tests/unit/test_loadgen.py."""

from __future__ import annotations

from autotune.traffic import RequestSpec, Schedule

PROMPT = (11, 12, 13, 14, 15)


def closed(
    n: int, *, conc: int, max_tokens: int = 12, prompt: tuple[int, ...] = PROMPT
) -> Schedule:
    reqs = tuple(RequestSpec(i, prompt, max_tokens) for i in range(n))
    return Schedule(mode="closed", requests=reqs, concurrency=conc)


STREAM = (
    b": keep-alive comment\r\n\r\n"
    b"event: message\r\n"
    b'data: {"choices":[{"index":0,"text":" a","finish_reason":null}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2}}\r\n\r\n'
    b'data:{"choices":[{"index":0,"text":" b","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\n'
    b"data: [DONE]\n\n"
)
