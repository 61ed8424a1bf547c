"""What only a stand-in model needs, dropped from what is printed for deployment.

A stand-in (random weights, ``autotune model tiny`` or a real architecture without its
checkpoint) is served with ``--load-format dummy``, vLLM's MoE routing simulator and a
synthetic MTP acceptance (the space's ``stand_in`` part, ``search_spaces/*.yaml``). The
figures measured on it are a stand-in's; a deployment with those settings would serve
random weights. :func:`deployable` drops them and says which.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["STAND_IN_NOTE", "Deployable", "deployable"]

_ROUTING_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"  # autotune.space.ROUTING_SIMULATION_ENV
_SPEC_KEYS = ("rejection_sample_method", "synthetic_acceptance_length")

#: the line every deployment output carries when a stand-in setting was dropped
STAND_IN_NOTE = ("the figures came from a stand-in (random weights); its stand-in-only "
                 "settings are dropped here: measure the real checkpoint before relying on "
                 "them")


@dataclass(frozen=True)
class Deployable:
    """Engine flags and environment fit to deploy, and what was dropped (``dropped``:
    human-readable items; empty when the config had no stand-in setting)."""

    flags: list[str]
    env: dict[str, str]
    dropped: list[str] = field(default_factory=list)

    @property
    def stand_in(self) -> bool:
        return bool(self.dropped)


def _spec_config(value: str, dropped: list[str]) -> str | None:
    """``--speculative-config`` JSON without the synthetic acceptance (None: nothing left)."""
    try:
        cfg = json.loads(value)
    except ValueError:
        return value
    if not isinstance(cfg, dict):
        return value
    gone = [k for k in _SPEC_KEYS if k in cfg and not (k == "rejection_sample_method"
                                                       and cfg[k] != "synthetic")]
    if not gone:
        return value
    for k in gone:
        dropped.append(f"--speculative-config {k}={cfg.pop(k)}")
    return json.dumps(cfg, separators=(",", ":")) if cfg else None


def deployable(flags: Sequence[str], env: Mapping[str, str]) -> Deployable:
    """``flags`` and ``env`` without ``--load-format dummy``, the MoE routing simulator and
    the synthetic MTP acceptance (see the module's docstring)."""
    out: list[str] = []
    dropped: list[str] = []
    items = list(flags)
    i = 0
    while i < len(items):
        name, eq, inline = items[i].partition("=")
        has_next = not eq and i + 1 < len(items) and not items[i + 1].startswith("--")
        value = inline if eq else (items[i + 1] if has_next else None)
        step = 1 if eq or not has_next else 2
        if name == "--load-format" and value == "dummy":
            dropped.append("--load-format dummy")
        elif name == "--speculative-config" and value is not None:
            kept = _spec_config(value, dropped)
            if kept is not None:
                out.extend([name + "=" + kept] if eq else [name, kept])
        else:
            out.extend(items[i:i + step])
        i += step
    kept_env = {k: v for k, v in env.items() if k != _ROUTING_ENV}
    if _ROUTING_ENV in env:
        dropped.append(f"{_ROUTING_ENV}={env[_ROUTING_ENV]}")
    return Deployable(flags=out, env=kept_env, dropped=dropped)
