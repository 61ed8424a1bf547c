"""A trial's replay plan: the schedule built from the shape for the model's context, and
what every trial mode is handed besides it (the client's settings, the phase reporter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from autotune.errors import ConfigError
from autotune.load import build_prompts, model_vocab_size
from autotune.trial._spec import TrialOutcome, TrialSpec, model_max_len

if TYPE_CHECKING:
    from autotune.traffic import Schedule

logger = logging.getLogger(__name__)

#: ``phase(name, detail)``: a trial's phase as it begins (the trial's number and clock are
#: the caller's)
PhaseFn = Callable[[str, str], None]


class ClientKw(TypedDict):
    """The load generator's client settings of a trial (keywords of
    :func:`autotune.load.replay`): its server and API."""

    base_url: str
    model: str
    api: str
    request_timeout_s: float


class _LoopMode:
    """What the closed and the open loop share as trial modes
    (:class:`~autotune.trial._modes.TrialMode`): the prompt tokens their requests sent
    count, and they add no figures of their own."""

    counts_prompt_tokens = True

    def metrics(self, spec: TrialSpec, outcome: TrialOutcome) -> dict[str, float]:
        return {}


@dataclass(frozen=True)
class _Plan:
    """What the trial replays (built before the server starts: bad input costs no start)."""

    vocab: int
    max_len: int
    schedule: Schedule

    @property
    def schedule_rate(self) -> float:
        """An open-loop schedule's mean arrival rate (req/s; 0 for a burst)."""
        last = max((r.send_at_s or 0.0 for r in self.schedule.requests), default=0.0)
        return len(self.schedule.requests) / last if last > 0 else 0.0


def _schedule(spec: TrialSpec, max_len: int, **kwargs: Any) -> Schedule:
    """The shape's replay with prompts exact for this model's tokenizer and the API
    (:mod:`autotune.prompts`); a request that does not fit ``max_len`` is clipped to fit."""
    if spec.shape is None:
        raise ConfigError(f"trial {spec.number} has no traffic shape to replay; give the "
                          "TrialSpec one (shape=load_shape(path))")
    schedule: Schedule = build_prompts(spec.shape, model=spec.model, api=spec.measure.api,
                                       max_total_tokens=max_len,
                                       output_jitter=spec.measure.output_jitter, **kwargs)
    return schedule


def _plan(spec: TrialSpec) -> _Plan:
    from autotune.trial._replay_choice import replays_exact, replays_sessions

    replays_sessions(spec)  # a --replay that cannot be is an error before the start
    replays_exact(spec)
    vocab = model_vocab_size(spec.model)
    max_len = spec.max_model_len or model_max_len(spec.flags, spec.model)
    schedule = _schedule(spec, max_len, seed=spec.seed, concurrency=spec.measure.concurrency,
                         num_requests=spec.measure.num_requests)
    return _Plan(vocab, max_len, schedule)
