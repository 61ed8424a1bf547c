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
TraceFormat = Literal["openai_log", "azure", "burstgpt", "mooncake", "multi_turn"]
FORMATS: Final[tuple[str, ...]] = ("openai_log", "azure", "burstgpt", "mooncake", "multi_turn")
_CSV_COLUMNS: Final[dict[str, tuple[str, str, str]]] = {
    # format: (timestamp, input tokens, output tokens)
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
}
_CSV_TITLES: Final[dict[str, str]] = {"azure": "an Azure LLM inference", "burstgpt": "a BurstGPT"}
_CSV_CHUNK_ROWS: Final = 200_000
_MAX_EXAMPLES: Final = 10
_MOONCAKE_BLOCK_TOKENS: Final = 512
#: a multi-turn (Bailian-style) trace's ``hash_ids`` are 16-token blocks
_MULTI_TURN_BLOCK_TOKENS: Final = 16
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

    def add(self, ts: float, inp: int, out: int) -> None:
        """A kept row."""
        self.ts.append(ts)
        self.inp.append(inp)
        self.out.append(out)

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

    def add_blocks(self, ids: list[int]) -> None:
        """A kept row's prefix block ids (possibly none)."""
        self.blocks.extend(ids)
        self.offsets.append(len(self.blocks))

    def code(self, key: object) -> int:
        return self.codes.setdefault(f"{type(key).__name__}:{key}", len(self.codes))


@dataclass
class _TurnRaw:
    """The turn links of a multi-turn trace, aligned with the collector's kept rows:
    ``chat`` and ``parent`` are integer codes of ``chat_id`` / ``parent_chat_id`` (-1 = a
    first turn), ``lines`` the file lines. ``dropped`` maps the code of a turn left out
    (failed, zero tokens) to its parent's code, so that its next turn links past it."""

    chat: array[int] = field(default_factory=lambda: array("q"))
    parent: array[int] = field(default_factory=lambda: array("q"))
    lines: array[int] = field(default_factory=lambda: array("q"))
    dropped: dict[int, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    # lines of the turns whose parent no turn has, started as sessions of their own by
    # --skip-bad (the session links it cut)
    cut_lines: list[int] = field(default_factory=list)

    def add(self, chat: int, parent: int, line: int) -> None:
        """A kept turn: its code, its parent's code (-1 = none) and its line."""
        self.chat.append(chat)
        self.parent.append(parent)
        self.lines.append(line)

    def code(self, key: int | str) -> int:
        """The integer code of an id (``5`` and ``"5"`` are different ids)."""
        tag = f"{type(key).__name__}:{key}"
        got = self.codes.get(tag)
        if got is None:
            got = self.codes[tag] = len(self.names)
            self.names.append(repr(key))
        return got


@dataclass
class _Extra:
    """What a reader found beside the three main columns."""

    wall_clock: bool = False
    prefix: _PrefixRaw | None = None
    latencies: np.ndarray | None = None
    turns: _TurnRaw | None = None
