"""Stand-ins for the real parts, for experiments and tests that exercise the study itself.

:class:`SimulatedExecutor` runs no server: a function of a trial's params gives its
metrics (or a failure reason), so the real study loop (:class:`autotune.study.StudyLoop`)
can run hundreds of trials in seconds (experiments/sample_efficiency, tests).
"""

from autotune.testing._simulated import SimulatedExecutor, TimelineEntry, fidelity_outcome

__all__ = ["SimulatedExecutor", "TimelineEntry", "fidelity_outcome"]

# The streaming stub server (autotune.testing.stub_server: an OpenAI-compatible server
# with no model, for load-generator tests, the fault lab and capacity measurements) is
# imported by name: it is not needed by the study.
