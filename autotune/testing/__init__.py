"""Stand-ins for the real parts, for experiments and tests that exercise the study itself.

:class:`SimulatedExecutor` runs no server: a function of a trial's params gives its
metrics (or a failure reason), so the real study loop (:class:`autotune.study.StudyLoop`)
can run hundreds of trials in seconds (experiments/sample_efficiency, tests).
"""

from autotune.testing._simulated import SimulatedExecutor

__all__ = ["SimulatedExecutor"]
