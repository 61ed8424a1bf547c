"""A server's failure classes, read from its log and exit code (``FailureReason``), and
the log lines that show why.
"""

from __future__ import annotations

import logging
import re
import signal

from autotune.store import FailureReason

logger = logging.getLogger(__name__)


# Log patterns, most specific first. The first match decides the class.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        FailureReason.PORT_IN_USE,
        re.compile(r"address already in use|Errno 98", re.IGNORECASE),
    ),
    (
        FailureReason.OOM,
        re.compile(
            r"OutOfMemoryError|CUDA out of memory|out of memory|Cannot allocate memory|"
            r"MemoryError|No available memory for the cache blocks|"
            r"Available memory on node .* less than|"
            r"larger than the maximum number of tokens that can be stored in KV cache|"
            r"KV cache is needed, which is larger than the available KV cache memory|"
            r"insufficient memory|std::bad_alloc|Killed",
            re.IGNORECASE,
        ),
    ),
    (
        FailureReason.INVALID_CONFIG,
        re.compile(
            r"error: unrecognized arguments|error: argument |invalid choice|"
            r"ValidationError|ValueError|NotImplementedError|TypeError: .*argument|"
            r"is not supported|not supported (?:on|for|with)|must be (?:<=|>=|less|greater)|"
            r"requires? .*(?:to be|enabled)|incompatible",
            re.IGNORECASE,
        ),
    ),
)


def classify_failure(log_text: str, returncode: int | None, *, during_start: bool = True) -> str:
    """Map a dead server's log and exit code to a :class:`FailureReason` string.

    The log decides when it names a cause. A SIGKILL with no cause in the log is counted as
    out of memory: the kernel's OOM killer sends exactly that, and a server we stop
    ourselves never reaches this function.
    """
    for reason, pattern in _PATTERNS:
        if pattern.search(log_text):
            return reason
    if returncode is not None and returncode in (-signal.SIGKILL, 137):
        # At start the OOM killer is the usual sender; later, anything may be (a person, a
        # fault injector, the OOM killer too): the log did not say, so it just died.
        return FailureReason.OOM if during_start else FailureReason.DIED
    return FailureReason.CRASH


def classifying_lines(log_text: str, reason: str, *, context: int = 1,
                      max_lines: int = 12, tail: bool = True) -> list[str]:
    """The lines of a server log that :func:`classify_failure` matched for ``reason`` (with
    ``context`` lines around each), or (``tail``) the log's last lines when no pattern names
    it (a crash, a timeout): what a person reads to see why a trial failed."""
    lines = log_text.splitlines()
    pattern = dict(_PATTERNS).get(reason)
    hits = [i for i, ln in enumerate(lines) if pattern is not None and pattern.search(ln)]
    if not hits:
        return lines[-max_lines:] if tail else []
    keep: list[int] = []
    for i in hits:
        for j in range(max(0, i - context), min(len(lines), i + context + 1)):
            if j not in keep:
                keep.append(j)
    return [lines[j] for j in keep[:max_lines]]
