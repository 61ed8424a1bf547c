"""A replay that is mostly failing stops early and says why (loadgen abort hook). (the pure part: no server, no subprocess; the rest is tests/integration/test_loadgen_abort.py)"""

from __future__ import annotations

from autotune.load import RequestRecord, failure_abort


def _rec(error: str | None, detail: str | None = None) -> RequestRecord:
    return RequestRecord(index=0, send_s=0.0, first_token_s=None, end_s=1.0, chunk_times_s=(),
                         chunk_tokens=(), prompt_tokens=None, output_tokens=0,
                         ok=error is None, error=error, detail=detail, status=None)


def test_abort_waits_for_the_minimum_then_names_the_cause() -> None:
    check = failure_abort(min_requests=4, max_failed_fraction=0.5)
    assert check(_rec("timeout"), 1, 1) is None  # too few to judge
    assert check(_rec(None), 2, 1) is None
    assert check(_rec("stalled"), 3, 2) is None
    line = check(_rec("stalled"), 4, 3)
    assert line is not None and "3 of 4" in line and "--rate-scale" in line
    assert "\n" not in line
    ctx = failure_abort(min_requests=2)
    detail = "This model's maximum context length is 1024 tokens"
    ctx(_rec("http_4xx", detail), 1, 1)
    line = ctx(_rec("http_4xx", detail), 2, 2)
    assert line is not None and "context" in line and "--max-total-tokens" in line
