"""Helpers shared by tests/integration/test_quality.py and tests/unit/test_quality.py."""

from __future__ import annotations

from typing import Any

from autotune.quality import (
    ProbeSet,
    QualitySpec,
    build_probe,
)
from autotune.traffic import LoadSpec, constant_shape

VOCAB = 4096


SHAPE = constant_shape(700, 64, load=LoadSpec(mode="closed", concurrency=4))


def _small_probe(**kw: Any) -> ProbeSet:
    return build_probe(SHAPE, vocab_size=VOCAB,
                       spec=QualitySpec(n_prompts=6, max_input_tokens=12, output_tokens=5, **kw))
