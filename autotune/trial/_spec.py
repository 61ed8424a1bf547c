"""The records of a trial that cross the executor boundary: ``TrialSpec`` in,
``TrialOutcome`` out; and the interrupt that ends a running measurement.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict

from autotune.config import MeasureSettings
from autotune.errors import ConfigError

if TYPE_CHECKING:  # annotations only: this module stays as light as the records it holds
    from autotune.measure import CoarseRecord, MeasurementRecord, Screen, SegmentRule, Slo
    from autotune.quality import ProbeOutputs, ProbeSet, QualityRecord
    from autotune.store import FailureReason
    from autotune.traffic import TrafficShape
    from autotune.trial._capacity import CapacityRecord, CapacitySearch
    from autotune.trial._levels import LevelPlan

logger = logging.getLogger(__name__)
INTERRUPT = threading.Event()
_ARMED = threading.Event()  # a closed-loop measurement that INTERRUPT ends is running


def interrupt() -> bool:
    """End the running closed-loop measurement now and keep what it measured
    (``autotune bench`` calls it on SIGTERM or Ctrl-C): the requests in flight are
    cancelled, the segments they left incomplete dropped, no further repeat starts; the
    trial's ``stop`` is ``interrupted`` (its ``reason`` ``interrupted`` when no segment was
    measured yet). False when no such measurement is running (a server start, an open-loop
    or capacity run): stop those another way (KeyboardInterrupt)."""
    if not _ARMED.is_set():
        return False
    INTERRUPT.set()
    return True


class WarmupRecord(TypedDict):
    """``TrialOutcome.warmup`` (the ``autotune.warmup`` attribute): how the warm-up ended.
    Every loop writes the first four keys; the closed loop adds the JIT counts and the
    warm-up segments' rates, the open loop also its steady state (the keys marked not
    required)."""

    seconds: float
    segments: int
    converged: bool
    jit_in_last_segment: bool
    jit_events: NotRequired[int]  # kernels the server log showed JIT-compiled in the warm-up
    jit_segments_measuring: NotRequired[int]  # measured segments (levels) that compiled one
    rates: NotRequired[list[float]]  # the warm-up segments' rates (tok/s)
    # the open loop's steady state (autotune.trial.OpenRun.warmup_record)
    rate_rps: NotRequired[float]
    request_s: NotRequired[float | None]
    requests_in_flight: NotRequired[int]
    steady_in_flight: NotRequired[float | None]
    overloaded: NotRequired[bool]
    served_share: NotRequired[float | None]
    rule: NotRequired[Literal["steady_state"]]


@dataclass(frozen=True)
class TrialSpec:
    """Everything a worker needs to run one trial (picklable, sent to Ray workers)."""

    number: int
    model: str
    flags: tuple[str, ...]
    env: dict[str, str]
    shape: TrafficShape | None  # None: a trial that replays nothing (a simulated executor)
    # the shape's file: the fix commands a failed replay suggests name it (issue 66)
    shape_path: str | None = None
    seed: int = 0
    # how it is measured (warm-up, adaptive stop, SLOs, timeouts, caches): the settings of
    # ``autotune tune`` and ``autotune bench`` (autotune.study.trial_spec builds both)
    measure: MeasureSettings = field(default_factory=MeasureSettings)
    max_model_len: int | None = None
    log_dir: str | None = None
    gpus: tuple[int, ...] | None = None
    # GPUs the server uses (tensor x pipeline x data parallel size of its flags): what the
    # executor reserves for it, and what the GPUs the traffic needs are counted in
    server_gpus: int = 1
    quality_probe: ProbeSet | None = None  # probe this trial's server
    quality_reference: ProbeOutputs | None = None  # the reference's outputs to compare with
    log_path: str | None = None  # the server log's own path (default: in log_dir by number)
    # The pruner: the incumbent's interval low end (output tokens/s); a trial whose own
    # interval lies wholly below it is stopped as a clear loser (reason "pruned").
    incumbent_low: float | None = None
    # Screen, then refine: the bar of this trial's coarse reading (None: measured to full
    # resolution at once); a coarse reading below it stops the trial, screened
    screen: Screen | None = None
    stagger: bool = True  # closed loop: desynchronise the streams' first requests
    # stop a measured replay once more than this share of >= 20 finished requests failed
    # (the outcome then says why in one line); None: always run to the end
    abort_failed_fraction: float | None = 0.5
    # -- issue 15: --objective capacity: a bracketing search over the arrival-rate scale on
    # this one server
    capacity: CapacitySearch | None = None
    capacity_plan: LevelPlan | None = None

    @property
    def slo(self) -> Slo | None:
        """The per-request goodput thresholds of ``measure.slo`` (None: no SLO)."""
        from autotune.measure import goodput_slo  # numpy and scipy: not for every import

        return goodput_slo(self.measure.slo)

    @property
    def rule(self) -> SegmentRule:
        """How the closed loop's run is cut into warm-up and measurement (and an open
        loop's sub-windows judged): ``measure``'s warm-up and stop settings."""
        from autotune.measure import SegmentRule

        return SegmentRule.of(self.measure)

    def capacity_search(self) -> CapacitySearch:
        """The bracketing search of an ``--objective capacity`` trial."""
        if self.capacity is None:
            raise ConfigError(f"trial {self.number} has no capacity search (spec.capacity); "
                              "set one to run load levels")
        return self.capacity


@dataclass
class TrialOutcome:
    """What happened: a measurement, or a failure reason with the evidence."""

    number: int
    ok: bool
    reason: FailureReason | None = None  # why, when not ok
    message: str = ""
    measurement: MeasurementRecord | None = None  # Measurement.record()
    metrics: dict[str, float] = field(default_factory=dict)  # Measurement.flat()
    start_s: float | None = None  # launch to healthy
    # of start_s: seconds vLLM logged compiling (torch.compile, "... took X s in total");
    # None when the log says nothing (e.g. --enforce-eager). A second start of the same
    # flags loads the compiled graphs from the cache and mostly skips this.
    compile_s: float | None = None
    # of start_s: where vLLM's log dates its parts (start_phases(): engine spawn, weights,
    # torch.compile, kernel JIT, CUDA-graph capture); empty when it dates none
    start_phases: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    log_path: str | None = None
    log_tail: str = ""
    engine_version: str = ""
    hostname: str = ""
    node_id: str = ""  # the Ray node that ran the trial ("" outside Ray)
    quality: QualityRecord | None = None  # QualityReport.record() of a probed trial
    quality_note: str = ""  # why a lossy trial has no quality figures
    gpus: tuple[int, ...] | None = None
    # -- issue 14: time account (seconds; start_s above), warm-up, segments, stop --
    warmup_s: float = 0.0
    measure_s: float = 0.0
    warmup: WarmupRecord | None = None
    segments: list[float] = field(default_factory=list)  # measured segment rates (tok/s)
    # why measuring stopped: precise | cap | pruned | failing | schedule_end | interrupted
    stop: str | None = None
    pruned: bool = False  # a clear loser: stopped early against the incumbent
    # screen, then refine: the coarse reading (spec.screen given and reached), and whether
    # the trial stopped there (screened) instead of going on to full resolution
    coarse: CoarseRecord | None = None
    screened: bool = False
    # prompt tokens of the measured runs (warm-up segments included): what the schedule
    # asked for, over the requests served, and the server's vllm:prompt_tokens delta
    prompt_tokens_sent: int = 0
    prompt_tokens_server: float | None = None
    # --objective capacity: CapacityResult.to_dict() (the bracket and every load level)
    capacity: CapacityRecord | None = None
    # measured on a server an earlier trial started (run_trials_on_one_server): start_s 0,
    # the start is that trial's
    server_reused: bool = False

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def model_max_len(flags: tuple[str, ...] | list[str], model: str | Path) -> int:
    """The server's max model length: --max-model-len if given, else the config's."""
    flags = list(flags)
    if "--max-model-len" in flags:
        return int(flags[flags.index("--max-model-len") + 1])
    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 2048))
