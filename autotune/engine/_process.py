"""The server's process group: a reaper that outlives the tuner, waiting for the group to
be gone, and the root cause of a crash read from its log.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time

logger = logging.getLogger(__name__)


_REAPER = """
import os, signal, sys, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
if os.fork():  # detach: a parent's process-tree cleanup must not take the reaper along
    os._exit(0)
pgid = int(sys.argv[1])
sys.stdin.buffer.read()  # returns when the tuner closes the pipe or dies
for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        break
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.2)
"""


def _start_reaper(pgid: int) -> subprocess.Popen[bytes] | None:
    """A detached watcher that stops the server's whole process group when this process
    dies for any reason (SIGKILL included), so no engine process outlives the tuner."""
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _REAPER, str(pgid)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        logger.warning("no reaper for vLLM group %s: %s", pgid, exc)
        return None


_CAUSE = re.compile(r"(?:^|\]\s+|\s)((?:[A-Za-z_]\w*\.)*[A-Z][A-Za-z]*(?:Error|Exception): .+)$")


def root_cause(text: str) -> str | None:
    """The first exception line of the server's log ("IndexError: index 3 is out of
    bounds ..."), where a crash starts; the tail is often shutdown noise. None if none."""
    for line in text.splitlines():
        if " WARNING " in line or " INFO " in line:
            continue
        m = _CAUSE.search(line.rstrip())
        if m is not None and "Traceback" not in m.group(1):
            return m.group(1)[:300]
    return None


def _last_lines(text: str, n: int) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg(0); look for a live member in /proc.
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _wait_group_gone(pgid: int, timeout_s: float, errors: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            errors.append(f"processes of group {pgid} still alive after SIGKILL")
            return
        time.sleep(0.1)
