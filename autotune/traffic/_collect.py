"""What every trace reader shares: the collector of rows and skipped lines, opening a
(gzipped) file, and the extra columns a reader hands back.
"""

from __future__ import annotations

import gzip
import io
import logging
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, TextIO

import numpy as np

from autotune.errors import TraceFormatError
from autotune.traffic._records import (
    SkippedLine,
)

logger = logging.getLogger(__name__)
TraceFormat = Literal["openai_log", "azure", "burstgpt", "mooncake"]
FORMATS: Final[tuple[str, ...]] = ("openai_log", "azure", "burstgpt", "mooncake")
_CSV_COLUMNS: Final[dict[str, tuple[str, str, str]]] = {
    # format: (timestamp, input tokens, output tokens)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}
_CSV_TITLES: Final[dict[str, str]] = {"azure": "an Azure LLM inference", "burstgpt": "a BurstGPT"}
_CSV_CHUNK_ROWS: Final = 200_000
_MAX_EXAMPLES: Final = 10
_MOONCAKE_BLOCK_TOKENS: Final = 512
_FIX = "fix the row or pass --skip-bad"


def _negative_time(key: str, value: object, unit: str = "seconds") -> str:
    """Why a row whose arrival time is negative is refused (a trace's times count from its
    start, or from the epoch: a negative one is a wrong column or a shifted clock, and
    fitting it would shift every gap silently)."""
    return (f"{key!r} is {value}, a negative arrival time; timestamps are {unit} since the "
            "trace began (or since the unix epoch) and are never below 0: shift the column "
            "so that its first time is 0")
_FAILED_STATUS: Final = frozenset(
    {"error", "failed", "failure", "timeout", "cancelled", "canceled", "aborted"}
)


@dataclass
class _Collector:
    """Growing numeric columns plus the bookkeeping of bad and failed lines."""

    name: str
    skip_bad: bool
    ts: array[float] = field(default_factory=lambda: array("d"))
    inp: array[int] = field(default_factory=lambda: array("q"))
    out: array[int] = field(default_factory=lambda: array("q"))
    skipped: int = 0
    failed: int = 0
    examples: list[SkippedLine] = field(default_factory=list)

    def bad(self, line: int, reason: str) -> None:
        """A bad line: raise, or count it when skipping."""
        if not self.skip_bad:
            raise TraceFormatError(f"traffic file {self.name} line {line}: {reason} ({_FIX})")
        self.skipped += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(SkippedLine(line, reason))


def _is_gzip(p: Path) -> bool:
    with p.open("rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def _open_text(p: Path) -> TextIO:
    if _is_gzip(p):
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8")
    return p.open("r", encoding="utf-8")


@dataclass
class _PrefixRaw:
    """Raw prefix columns of a JSONL trace, aligned with the collector's kept rows."""

    blocks: array[int] = field(default_factory=lambda: array("q"))
    offsets: array[int] = field(default_factory=lambda: array("q", [0]))
    session: array[int] = field(default_factory=lambda: array("q"))
    prefix_id: array[int] = field(default_factory=lambda: array("q"))
    prefix_tokens: array[int] = field(default_factory=lambda: array("q"))
    codes: dict[str, int] = field(default_factory=dict)
    seen_session: bool = False
    seen_prefix: bool = False

    def code(self, key: object) -> int:
        return self.codes.setdefault(f"{type(key).__name__}:{key}", len(self.codes))


@dataclass
class _Extra:
    """What a reader found beside the three main columns."""

    wall_clock: bool = False
    prefix: _PrefixRaw | None = None
    latencies: np.ndarray | None = None
