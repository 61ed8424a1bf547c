"""The steps of a rollout (pure): which servers the router holds at each step.

A step value is a count of new servers (``1``) or a share of the fleet (``50%``); the last
step is always ``100%``: every new server in, every old one out. Within a step new servers
are added before old ones are taken out, so capacity never drops. Every step but the last
keeps at least one old server in the router: that is what the new ones are compared with.
The last step is the switch; the old servers stay up (out of the router) while it is held,
so a rollback can still put them back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.errors import ConfigError

__all__ = ["DEFAULT_STEPS", "Step", "parse_steps", "plan_steps"]

DEFAULT_STEPS = "1,50%,100%"


@dataclass(frozen=True)
class Step:
    """One step: the servers the router holds while it is held."""

    number: int  # 1-based
    label: str  # as given: "1", "50%", "100%"
    new: tuple[str, ...]  # new servers in the router
    old: tuple[str, ...]  # old servers in the router
    final: bool  # the switch: no old server left to compare with

    def as_dict(self) -> dict[str, object]:
        return {"step": self.number, "label": self.label, "new": list(self.new),
                "old": list(self.old), "final": self.final}


def parse_steps(text: str) -> list[tuple[str, float | int]]:
    """``"1,50%,100%"`` -> ``[("1", 1), ("50%", 0.5), ("100%", 1.0)]`` (a share is a float,
    a count an int). Raises :class:`ConfigError` on anything else."""
    out: list[tuple[str, float | int]] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            if part.endswith("%"):
                share = float(part[:-1]) / 100.0
                if not 0.0 < share <= 1.0:
                    raise ValueError
                out.append((part, share))
            else:
                count = int(part)
                if count < 1:
                    raise ValueError
                out.append((part, count))
        except ValueError:
            raise ConfigError(
                f"--steps {text!r}: {part!r} is neither a server count >= 1 nor a share "
                "in (0%, 100%]; e.g. --steps 1,50%,100%"
            ) from None
    if not out:
        raise ConfigError("--steps is empty; e.g. --steps 1,50%,100%")
    return out


def plan_steps(*, old: Sequence[str], new: Sequence[str], steps: str = DEFAULT_STEPS
               ) -> list[Step]:
    """The router's membership step by step, from ``old`` (in it now) to ``new``."""
    if not new:
        raise ConfigError("no new server to roll out; give --new URL or --start")
    if not old:
        raise ConfigError("the router holds no old server to compare with; give --old URL "
                          "or add the current servers to the router first")
    both = set(old) & set(new)
    if both:
        raise ConfigError(f"{sorted(both)[0]} is both an old and a new server; a new server "
                          "must not be in the router yet")
    n_old, n_new = len(old), len(new)
    plan: list[Step] = []
    seen: set[tuple[int, int]] = set()
    for label, value in [*parse_steps(steps), ("100%", 1.0)]:
        # a count is never the switch: only "100%" (always the last step) takes every old
        # server out
        final = isinstance(value, float) and value >= 1.0
        share = min(value / n_new if isinstance(value, int) else value, 1.0)
        k_new = max(1, min(n_new, math.ceil(share * n_new - 1e-9)))
        k_old_out = n_old if final else min(n_old - 1, math.floor(share * n_old + 1e-9))
        key = (k_new, n_old - k_old_out)
        if key in seen:
            continue
        seen.add(key)
        plan.append(Step(number=len(plan) + 1, label="100%" if final else label,
                         new=tuple(new[:k_new]), old=tuple(old[k_old_out:]), final=final))
        if final:
            break
    return plan
