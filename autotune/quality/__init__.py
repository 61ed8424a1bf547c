"""Quality gate for lossy knobs: a fixed greedy probe compared with a full-precision reference.

Some knobs buy speed with accuracy (an FP16/BF16 Mamba SSM state, an FP8 KV cache). A trial
whose config sets such a knob (``lossy: true`` in the search space) away from its reference
value runs a small, seeded probe on its own server after the measurement: greedy
continuations with per-token logprobs of a fixed prompt set, compared with the same prompts
on the *reference* config (the study's defaults with every lossy knob at its full-precision
default and no speculation), computed once per model, flags and engine and cached on disk:
the prompt set is the same for every traffic shape, so a study of another shape reads it.

The pieces, in the order a study uses them (one private module per concern, re-exported
here):

* :class:`QualitySpec` and :func:`build_probe`: the deterministic prompt set (:class:`ProbeSet`);
* :func:`reference_params`: the knob values of the reference config of a search space;
* :class:`ReferenceCache` and :func:`ensure_reference`: the reference outputs, cached;
* :func:`run_probe` (:func:`arun_probe` inside an event loop): one server's outputs;
* :func:`compare`: reference vs candidate -> :class:`QualityReport` (``.flat()`` for metrics);
* :func:`parse_quality` and :func:`quality_violation`: user thresholds -> an Optuna
  constraint value (> 0 = violated);
* :func:`lm_eval_command`: an lm-evaluation-harness command to score a config's server on
  real tasks (real weights only). See docs/quality.md.

This is a numerical-drift probe, not an accuracy benchmark: it says how often and how early
a lossy config's greedy output leaves the reference's, which is what can be measured with
random weights and random prompts. Real accuracy needs real weights and real tasks.
"""

from autotune.quality._caveat import caveat_line, quality_caveat, quality_figure, result_of
from autotune.quality._client import ProbeOutputs, arun_probe, run_probe
from autotune.quality._compare import (
    QUALITY_KEYS,
    QualityRecord,
    QualityReport,
    QualityThresholds,
    compare,
    parse_quality,
    quality_violation,
)
from autotune.quality._lm_eval import lm_eval_command
from autotune.quality._probe import ProbeSet, QualitySpec, build_probe
from autotune.quality._reference import (
    ProbeServer,
    ReferenceCache,
    ReferenceKey,
    ensure_reference,
    model_fingerprint,
    reference_params,
)

__all__ = [
    "QUALITY_KEYS",
    "ProbeOutputs",
    "ProbeServer",
    "ProbeSet",
    "QualityRecord",
    "QualityReport",
    "QualitySpec",
    "QualityThresholds",
    "ReferenceCache",
    "ReferenceKey",
    "arun_probe",
    "build_probe",
    "caveat_line",
    "compare",
    "ensure_reference",
    "lm_eval_command",
    "model_fingerprint",
    "parse_quality",
    "quality_caveat",
    "quality_figure",
    "quality_violation",
    "reference_params",
    "result_of",
    "run_probe",
]
