"""``study.json``: the summary of a finished study (trial counts, the verdict, the GPU-time
account and the resolved settings), beside best.json in its output folder."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from autotune.records._file import JsonValue, StudyFileModel

__all__ = ["StudyFile"]


class StudyFile(StudyFileModel):
    """``study.json``. ``settings`` is the resolved, redacted config (config.yaml's);
    ``verdict`` the study's ``autotune.verdict``; ``gpu_time`` its ``autotune.gpu_time``."""

    FILE_NAME: ClassVar[str] = "study.json"

    study: str
    storage: str = ""  # redacted
    tracking_uri: str = ""  # redacted
    trials: int = 0
    ok: int = 0
    failed: int = 0
    pruned: int = 0
    # screen, then refine: {"screened": stopped at rung 0, "refined": full resolution}
    rungs: dict[str, int] = Field(default_factory=dict)
    failures_by_reason: dict[str, int] = Field(default_factory=dict)
    best_trial: int | None = None
    best_value: float | None = None
    baseline_value: float | None = None
    explanation: str = ""
    verdict: dict[str, JsonValue] = Field(default_factory=dict)
    gpu_time: dict[str, dict[str, float]] = Field(default_factory=dict)
    settings: dict[str, JsonValue] = Field(default_factory=dict)
