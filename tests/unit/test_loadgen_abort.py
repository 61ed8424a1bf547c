"""A replay that is mostly failing stops early and says why (loadgen abort hook). (the pure
part: no server, no subprocess; the rest is tests/integration/test_loadgen_abort.py)"""

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


def test_the_fix_commands_name_the_shape_file_the_context_and_a_scale() -> None:
    """Issue 66: the commands the lines suggest run as printed (tests/integration/
    test_cli_errors.py runs them): the shape's file, the context the 4xx names, and a rate
    scale from the share the server served."""
    from autotune.load import clip_command

    ctx = failure_abort(min_requests=2, shape_path="shapes/chat.json")
    detail = "This model's maximum context length is 1024 tokens. However, you requested 2000"
    ctx(_rec("http_4xx", detail), 1, 1)
    line = ctx(_rec("http_4xx", detail), 2, 2)
    assert line is not None and (
        "(autotune shape clip shapes/chat.json --max-total-tokens 1024 "
        "-o shapes/chat-1024.json)") in line
    slow = failure_abort(min_requests=10, shape_path="my shapes/chat.json")
    for i in range(1, 11):
        line = slow(_rec(None) if i <= 4 else _rec("timeout"), i, max(0, i - 4))
    # 4 of 10 served: 0.4 less a fifth
    assert line is not None and ("autotune shape clip 'my shapes/chat.json' --rate-scale 0.32 "
                                 "-o 'my shapes/chat-x0.32.json'") in line
    # no file known: no placeholder, the options with their values
    bare = failure_abort(min_requests=2, context=2048)
    bare(_rec("http_4xx", "too long"), 1, 1)
    line = bare(_rec("http_4xx", "too long"), 2, 2)
    assert line is not None and "2048-token context" in line and "SHAPE" not in line
    assert clip_command("a.json", context=8, rate_scale=0.5) == (
        "autotune shape clip a.json --max-total-tokens 8 --rate-scale 0.5 -o a-8-x0.5.json")
