"""A trial's replay plan: the schedule built from the shape for the model's context.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from autotune.errors import ConfigError
from autotune.load import build_prompts, model_vocab_size
from autotune.trial._spec import TrialSpec, model_max_len

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """What the trial replays (built before the server starts: bad input costs no start)."""

    vocab: int
    max_len: int
    schedule: Any  # autotune.traffic.Schedule

    @property
    def schedule_rate(self) -> float:
        """An open-loop schedule's mean arrival rate (req/s; 0 for a burst)."""
        last = max((r.send_at_s or 0.0 for r in self.schedule.requests), default=0.0)
        return len(self.schedule.requests) / last if last > 0 else 0.0


def _schedule(spec: TrialSpec, max_len: int, **kwargs: Any) -> Any:
    """The shape's replay with prompts exact for this model's tokenizer and the API
    (:mod:`autotune.prompts`); a request that does not fit ``max_len`` is clipped to fit."""
    if spec.shape is None:
        raise ConfigError(f"trial {spec.number} has no traffic shape to replay; give the "
                          "TrialSpec one (shape=load_shape(path))")
    return build_prompts(spec.shape, model=spec.model, api=spec.measure.api,
                         max_total_tokens=max_len, output_jitter=spec.measure.output_jitter,
                         **kwargs)


def _plan(spec: TrialSpec) -> _Plan:
    vocab = model_vocab_size(spec.model)
    max_len = spec.max_model_len or model_max_len(spec.flags, spec.model)
    schedule = _schedule(spec, max_len, seed=spec.seed, concurrency=spec.measure.concurrency,
                         num_requests=spec.measure.num_requests)
    return _Plan(vocab, max_len, schedule)
