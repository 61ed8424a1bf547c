"""Whether a trial replays its shape's sessions turn by turn (``--replay``): decided from
the spec alone, before its server starts (a request that cannot be is an error then).
"""

from __future__ import annotations

from autotune.errors import ConfigError
from autotune.trial._spec import TrialSpec


def replays_sessions(spec: TrialSpec) -> bool:
    """Whether ``spec`` replays its shape's sessions turn by turn (``--replay``: 'sessions';
    'auto' when the shape has sessions and the API is completions; a capacity search then
    scales the session rate, which 'auto' asks only of a shape that has one). A
    :class:`ConfigError` (one line) for 'sessions' that cannot be."""
    how = spec.measure.replay
    shape = spec.shape
    has = shape is not None and shape.sessions is not None
    if how == "independent" or (how == "auto" and not has):
        return False
    if how == "sessions":
        name = shape.name if shape is not None else None
        if not has:
            raise ConfigError(f"--replay sessions: shape {name!r} has no sessions section; "
                              "fit it from a trace that links turns (docs/traffic.md, "
                              "Sessions) or use --replay independent")
        if spec.measure.api != "completions":
            raise ConfigError("--replay sessions sends token-id prompts: use --api "
                              "completions (or --replay independent)")
        return True
    if spec.measure.api != "completions":
        return False
    sessions = shape.sessions if shape is not None else None
    return spec.capacity is None or (sessions is not None and sessions.rate_sps > 0)
