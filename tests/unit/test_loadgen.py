"""The load generator against a real local stub server that streams, and misbehaves on purpose. (the pure part: no server, no subprocess; the rest is tests/integration/test_loadgen.py)"""

from __future__ import annotations

import pytest

from autotune.errors import LoadgenError
from autotune.load import _SseParser, replay
from autotune.traffic import RequestSpec, Schedule
from tests._loadgen import PROMPT, STREAM, closed


@pytest.mark.parametrize(
    ("schedule", "kwargs", "match"),
    [
        (Schedule(mode="closed", requests=(RequestSpec(0, PROMPT, 4),)), {}, "concurrency=None"),
        (closed(1, conc=1, max_tokens=0), {}, "max_tokens is 0"),
        (Schedule(mode="open", requests=(RequestSpec(0, PROMPT, 4),)), {}, "send_at_s is None"),
        (
            Schedule(mode="open", requests=(RequestSpec(0, PROMPT, 4, send_at_s=float("nan")),)),
            {},
            "send_at_s is nan",
        ),
        (closed(1, conc=1), {"api": "embeddings"}, "api is 'embeddings'"),
        (closed(1, conc=1), {"base_url": "localhost:8000"}, "must start with http"),
        (closed(1, conc=1), {"stall_timeout_s": 0}, "timeouts must be > 0"),
        ("not a schedule", {}, "not a replay schedule"),
    ],
)
def test_unusable_input_raises_loadgen_error(schedule: object, kwargs: dict, match: str) -> None:
    args = {"base_url": "http://127.0.0.1:9", "model": "tiny", **kwargs}
    with pytest.raises(LoadgenError, match=match):
        replay(schedule, **args)  # type: ignore[arg-type]


def test_sse_parser_is_independent_of_how_bytes_are_split() -> None:
    results = set()
    for cut in range(1, len(STREAM)):
        p = _SseParser(chat=False)
        p.feed(STREAM[:cut], 1.0)
        p.feed(STREAM[cut:], 2.0)
        p.close()
        assert p.done and p.prompt_tokens == 3 and p.usage_total == 5
        results.add(tuple(p.tokens))
    assert results == {(2, 3)}


def test_sse_parser_rejects_an_unterminated_tail() -> None:
    from autotune.load import RequestFailure

    p = _SseParser(chat=False)
    p.feed(STREAM + b'data: {"choi', 1.0)
    with pytest.raises(RequestFailure) as info:
        p.close()
    assert info.value.reason == "malformed_sse"
