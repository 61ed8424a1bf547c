"""Helpers shared by tests/integration/test_quality.py and tests/unit/test_quality.py."""

from __future__ import annotations

from typing import Any

from autotune.quality import (
    ProbeSet,
    QualitySpec,
    build_probe,
)

VOCAB = 4096


def _small_probe(**kw: Any) -> ProbeSet:
    return build_probe(vocab_size=VOCAB,
                       spec=QualitySpec(n_prompts=6, max_input_tokens=12, output_tokens=5, **kw))
