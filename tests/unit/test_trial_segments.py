"""A trial's segmented warm-up and measurement, on the fault suite's fake vLLM. (the pure part: no server, no subprocess; the rest is tests/integration/test_trial_segments.py)"""

from __future__ import annotations

from pathlib import Path

from autotune.traffic import load_shape
from tests._specs import flat_spec
from tests.conftest import REPO


def test_a_trials_closed_loop_lengths_carry_its_output_jitter(fake_model: Path) -> None:
    """The schedule a trial replays (its refills are built the same way, with their own
    seeds): the case study's fixed 512 output tokens spread by --output-jitter, or exact."""
    from autotune.trial import _plan

    def outs(**kw: object) -> list[int]:
        spec = flat_spec(number=0, model=str(fake_model), flags=(), env={}, concurrency=8,
                         shape=load_shape(REPO / "traffic" / "casestudy-512x512.json"),
                         num_requests=300, **kw)
        return [r.max_tokens for r in _plan(spec).schedule.requests]

    jittered = outs()  # the default: 0.1
    assert min(jittered) >= 461 and max(jittered) <= 563 and len(set(jittered)) > 50
    assert set(outs(output_jitter=0.0)) == {512}
