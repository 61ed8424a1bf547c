"""The exception hierarchy: everything autotune raises derives from :class:`AutotuneError`.

Foreign errors are wrapped at the boundary (``raise EngineStartError(...) from exc``) so a
user never sees a bare ``KeyError`` or an aiohttp traceback. Messages say what is wrong,
the offending value, and the fix.
"""

from __future__ import annotations

import shlex
from pathlib import Path

__all__ = [
    "AutotuneError",
    "ConfigError",
    "EngineCrashedError",
    "EngineError",
    "EngineStartError",
    "LoadgenError",
    "ModelGenError",
    "RolloutError",
    "ShapeError",
    "SpaceError",
    "StudyError",
    "TraceFormatError",
    "TrackingError",
    "TrafficError",
    "clip_command",
]


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class ConfigError(AutotuneError):
    """A user-supplied option or configuration file is invalid."""


class TrafficError(AutotuneError):
    """Recorded traffic or a traffic shape cannot be used."""


class TraceFormatError(TrafficError):
    """A trace file is malformed (names the file, the line and the fix)."""


class ShapeError(TrafficError):
    """A traffic shape file is missing, malformed or inconsistent."""


class SpaceError(AutotuneError):
    """A search-space YAML file is invalid (unknown knob, bad range, contradictory rules)."""


class EngineError(AutotuneError):
    """The inference engine could not be started, reached or stopped."""


class EngineStartError(EngineError):
    """The engine did not become healthy. ``reason`` is a failure class (see engine)."""

    def __init__(self, message: str, *, reason: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.log_tail = log_tail


class EngineCrashedError(EngineError):
    """The engine died while it was being measured."""

    def __init__(self, message: str, *, reason: str = "crash", log_tail: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.log_tail = log_tail


class LoadgenError(AutotuneError):
    """The load generator could not run its schedule at all."""


class StudyError(AutotuneError):
    """The Optuna study cannot be created, loaded or resumed."""


class TrackingError(AutotuneError):
    """The MLflow store cannot be reached or written."""


class ModelGenError(AutotuneError):
    """A tiny model cannot be generated."""


class RolloutError(AutotuneError):
    """A rollout cannot start or go on (router, servers, options)."""


def clip_command(shape_path: str | Path, *, context: int | None = None,
                 rate_scale: float | None = None) -> str:
    """The ``autotune shape clip`` command, as it runs verbatim, that writes a copy of the
    shape at ``shape_path`` next to it with the lengths clipped to ``context`` tokens
    and/or the rate multiplied by ``rate_scale``: the fix an error message suggests."""
    src = Path(shape_path)
    opts, tag = [], []
    if context is not None:
        opts.append(f"--max-total-tokens {context}")
        tag.append(f"{context}")
    if rate_scale is not None:
        opts.append(f"--rate-scale {rate_scale:g}")
        tag.append(f"x{rate_scale:g}")
    out = src.with_name(f"{src.stem}-{'-'.join(tag) or 'clipped'}.json")
    return (f"autotune shape clip {shlex.quote(str(src))} {' '.join(opts)} "
            f"-o {shlex.quote(str(out))}")
