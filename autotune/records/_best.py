"""``best.json``: the config a study declares best, with the numbers it rests on
(written by :func:`autotune.results.write_results`; read by ``autotune best``, ``cost``,
``export``, ``rollout --start``, the report and the registry)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from autotune.events import ParamValue
from autotune.records._file import JsonValue, StudyFileModel

__all__ = ["BaselineRecord", "BestFile", "CapacityDeclared", "EngineRef", "GpusNeeded",
           "ObjectiveRecord", "ParetoPoint", "RatioRecord", "ShapeRef", "SpaceRef"]


class _Part(BaseModel):
    """A part of a file: unknown keys kept, as the file's own (:class:`StudyFileModel`)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class RatioRecord(_Part):
    """The declared config's reading over vLLM's defaults: the median and its interval."""

    median: float
    ci_low: float | None = None
    ci_high: float | None = None


class ObjectiveRecord(_Part):
    """What was maximised: ``value`` is per GPU (``per_gpu``) when the file says so (the
    server's figure / its GPUs, ``value_per_server``), else the server's."""

    name: str
    metric: str
    per_gpu: bool = False
    value: float
    value_per_server: float | None = None


class GpusNeeded(_Part):
    """The GPUs one server of the declared config uses and the servers (GPUs) the recorded
    traffic needs: at most (``needed_is`` "at_most", at least ``*_low``) or an estimate."""

    per_server: int = 1
    servers_needed: float | None = None
    gpus_needed: float | None = None
    servers_needed_low: float | None = None
    gpus_needed_low: float | None = None
    needed_is: str = "estimate"
    basis: str = ""


class CapacityDeclared(GpusNeeded):
    """``capacity``: the declared capacity (req/s, a server's), the bracket of the reading it
    rests on, output tokens/s there, and what the recorded traffic needs."""

    capacity_rps: float
    capacity_rps_ci_low: float | None = None
    capacity_rps_ci_high: float | None = None
    bracket_closed: bool | None = None
    output_tokens_per_s_at_capacity: float | None = None
    # the rate the level at capacity sent: the recording's busiest stretch, which each level
    # replays (``capacity_rps`` is the mean rate of that scale); output tokens/s are its
    busiest_rps_at_capacity: float | None = None
    recorded_rps: float = 0.0
    goodput_bar: float | None = None
    slo: dict[str, float] = Field(default_factory=dict)
    search: str | None = None  # the search's status ("bracketed", "flat", ...)
    flat_misses_rps: list[float] | None = None
    # each load level (autotune.trial.LevelRecord)
    levels: list[dict[str, JsonValue]] = Field(default_factory=list)
    # a session capacity search (sessions replayed turn by turn): the same capacity in
    # sessions/s, its bracket's top, and the recorded session rate (None otherwise)
    capacity_sps: float | None = None
    capacity_sps_ci_high: float | None = None
    recorded_sps: float | None = None


class BaselineRecord(_Part):
    """vLLM's defaults as measured in the same study (their median reading)."""

    trial: int
    value: float | None = None
    readings: list[float] = Field(default_factory=list)
    metrics: dict[str, float | None] = Field(default_factory=dict)
    server_gpus: int = 1


class ShapeRef(_Part):
    """The traffic shape the study was tuned for."""

    name: str = ""
    fingerprint: str = ""
    path: str = ""


class SpaceRef(_Part):
    """The search space the study drew from."""

    name: str = ""
    path: str = ""


class EngineRef(_Part):
    """The engine that ran the trials."""

    package: str = "vllm"
    version: str = ""
    device: str = ""


class ParetoPoint(_Part):
    """A config of the Pareto front (``--objective pareto``); its latency is the extra key
    ``<pareto_latency>_s`` (in ``model_extra``)."""

    trial: int
    output_tokens_per_s: float
    params: dict[str, ParamValue] = Field(default_factory=dict)
    serve_command: str = ""


class BestFile(StudyFileModel):
    """``best.json``: the study's winner (:func:`autotune.store.verdict`) as declared.

    A file written by an older autotune lacks some fields (``gpus``, ``quality``,
    ``recheck_of``, an objective's ``per_gpu``): they take their defaults here and stay
    absent when it is saved again."""

    FILE_NAME: ClassVar[str] = "best.json"

    verdict: str | None = None  # "winner" | "defaults_best" | "unverified" | "none"
    ratio_to_defaults: RatioRecord | None = None
    # the rest of autotune.verdict (store.VerdictRecord)
    verdict_detail: dict[str, JsonValue] = Field(default_factory=dict)
    params: dict[str, ParamValue] = Field(default_factory=dict)
    quality: dict[str, JsonValue] | None = None  # a lossy winner's word on accuracy
    serve_command: str = ""
    # the server's (Measurement.flat; a figure a store kept as null loads as None)
    metrics: dict[str, float | None] = Field(default_factory=dict)
    objective: ObjectiveRecord
    gpus: GpusNeeded | None = None
    readings: list[float] = Field(default_factory=list)  # per GPU when the objective is
    spread: float | None = None
    selection: str = ""
    flags: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    trial: int
    recheck_of: int | None = None  # the config's first trial, when this is a re-check
    is_baseline: bool = False
    baseline: BaselineRecord | None = None
    ratio_to_baseline: float | None = None
    study: str = ""
    storage: str = ""  # redacted
    shape: ShapeRef | None = None
    model: str
    space: SpaceRef | None = None
    engine: EngineRef | None = None
    slo: dict[str, float] = Field(default_factory=dict)
    seed: int | None = None
    mlflow_run_id: str | None = None
    created: str = ""
    autotune_version: str = ""
    capacity: CapacityDeclared | None = None  # --objective capacity
    cost: dict[str, JsonValue] | None = None  # autotune.cost.StudyCost.to_dict()
    pareto_latency: str | None = None  # --objective pareto
    pareto_front: list[ParetoPoint] | None = None
