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


def test_a_schedule_gets_the_driver_of_its_mode() -> None:
    """The mode is a driver: a closed loop's streams are its connections; an open loop
    needs one per request unless its concurrency caps what is in flight."""
    from autotune.load._modes import ClosedLoop, OpenLoop, driver_for

    shut = driver_for(closed(6, conc=2), stagger=True, refill=lambda i: [])
    assert isinstance(shut, ClosedLoop) and shut.stagger and shut.refill is not None
    assert (shut.mode, shut.concurrency, shut.connections(), len(shut.requests)) == (
        "closed", 2, 2, 6)
    reqs = tuple(RequestSpec(i, PROMPT, 4, send_at_s=0.1 * i) for i in range(5))
    free = driver_for(Schedule(mode="open", requests=reqs))
    assert isinstance(free, OpenLoop)
    assert (free.mode, free.concurrency, free.connections()) == ("open", None, 5)
    capped = driver_for(Schedule(mode="open", requests=reqs, concurrency=2))
    assert (capped.concurrency, capped.connections()) == (2, 2)
    with pytest.raises(LoadgenError, match="closed-loop schedules only"):
        driver_for(Schedule(mode="open", requests=reqs), refill=lambda i: [])
