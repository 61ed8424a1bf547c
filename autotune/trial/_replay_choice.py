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
    if how == "exact":
        return False
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


def replays_exact(spec: TrialSpec) -> bool:
    """Whether ``spec`` replays a hash-id trace exactly (``--replay exact``); a
    :class:`ConfigError` (one line) when it asks for it and cannot: no ``--trace``, a trace
    that is not there, a capacity search (its levels scale a shape's arrivals), or the chat
    API (the prompts are token ids)."""
    from pathlib import Path

    m = spec.measure
    if m.replay != "exact":
        return False
    if not m.trace:
        raise ConfigError("--replay exact replays a hash-id trace: give it with --trace FILE "
                          "(Mooncake JSONL: timestamp, input_length, output_length, hash_ids)")
    if not Path(m.trace).is_file():
        raise ConfigError(f"--trace {m.trace}: no such file")
    if spec.capacity is not None:
        raise ConfigError("--replay exact measures one replay of the trace at its recorded "
                          "times; a capacity search scales a shape's arrivals: use --replay "
                          "auto with --objective capacity / bench --capacity")
    if m.api != "completions":
        raise ConfigError("--replay exact sends token-id prompts: use --api completions")
    return True
