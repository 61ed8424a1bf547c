"""autotune: a Bayesian traffic-shape auto-tuner for vLLM.

The pipeline: recorded traffic -> traffic shape (:mod:`autotune.traffic`) -> search space
(:mod:`autotune.space`) -> study (:mod:`autotune.study`) -> trial (engine up, replay,
measure, engine down) -> tracking (:mod:`autotune.tracking`) -> best config per shape.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
