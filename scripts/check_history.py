"""Fail when a file tells the history of the project's own runs, or how its GPU host was
obtained, instead of describing the product.

    python scripts/check_history.py [PATH ...]     # default: every tracked text file

Prints `file:line: the words (why)` for each finding and exits 1 when there is one.
The words are those the lab notebook used: numbered GPU "sessions", the lender's machine
kinds and tool names, hosts that were or were not "lent", staging parts, and the scripts
that staged and polled a host. Ordinary uses pass: an HTTP or aiohttp session,
`session_id`, a process session (`setsid`, `start_new_session`), a session-scoped fixture, a
tuner's own session. Results belong in experiments/ as what was measured, with the command
and the date; the story of how it was measured belongs in git's log.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_NTH = ("third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
        "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
        "twenty-\\w+|thirtieth")
RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(rf"\b(?:{_NTH})\s+(?:(?:GPU|H100|H200|device)\s+)?sessions?\b", re.I),
     "a run of the project's own, numbered"),
    (re.compile(r"\b(?:first|second|next|last|earlier|later|previous|this|that|same|one|a|"
                r"each|every)\s+(?:GPU|H100|H200|device)\s+sessions?\b", re.I),
     "a GPU session of the project's own"),
    (re.compile(r"\bsessions?\s+(?:of|on)\s+20\d\d-\d\d-\d\d\b", re.I), "a dated session"),
    (re.compile(r"\bGPU-SESSIONS\b"), "the log of GPU sessions"),
    (re.compile(r"\bnvidia-h(?:100|200)(?:-x\d)?\b", re.I), "the GPU lender's machine kinds"),
    (re.compile(r"\b(?:give_back|can_start_another|files_fetch|budget_left_s\s+of)\b"),
     "the GPU lender's tool"),
    (re.compile(r"\b(?:was|were|been|is|are|not|never)\s+lent\b|\blent\s+(?:GPU|H100|H200|"
                r"host|machine)s?\b", re.I), "how a GPU host was obtained"),
    (re.compile(r"\bdevice[- ](?:minutes|budget)\b", re.I), "the GPU lender's budget"),
    (re.compile(r"\b(?:poll-lib|poll\.sh|carry-size|gpu-newfiles|gpu-bytecode|proof-x2)\b"),
     "a script that staged or polled a GPU host (removed)"),
]
TEXT = (".md", ".py", ".sh", ".yaml", ".yml", ".txt", ".toml", ".json", ".cfg", ".html")
# tests/ assert on log lines and carry comments of their own; this file names the words
SKIP = ("tests/", "scripts/check_history.py")


def findings(text: str) -> Iterator[tuple[int, str, str]]:
    """(line number, the words, why) for each line of ``text`` that tells such history."""
    for no, line in enumerate(text.splitlines(), 1):
        for pattern, why in RULES:
            m = pattern.search(line)
            if m:
                yield no, m.group(0).strip(), why
                break


def tracked(root: Path = REPO) -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return [p for p in out if p.endswith(TEXT) and not p.startswith(SKIP)]


def check(paths: Iterable[str], root: Path = REPO) -> list[str]:
    lines = []
    for rel in paths:
        p = root / rel
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines += [f"{rel}:{no}: {words!r} ({why})" for no, words, why in findings(text)]
    return lines


def main(argv: list[str]) -> int:
    found = check(argv or tracked())
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} line(s) tell the project's own run history or how a GPU host was "
              "obtained; say what the product does or what was measured (with its command), "
              "and leave the story to git's log", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
