"""The files a study writes, as typed models: ``best.json`` (:class:`BestFile`) and
``study.json`` (:class:`StudyFile`), each with ``load`` and an atomic ``save``.

A file written by an older autotune loads (a field it lacks takes its default and stays
absent when saved again; a key this version does not know is kept). The results, the
report, the CLI, export and rollout read these files through these models only.
"""

from __future__ import annotations

from autotune.records._best import (
    BaselineRecord,
    BestFile,
    CapacityDeclared,
    EngineRef,
    GpusNeeded,
    ObjectiveRecord,
    ParetoPoint,
    RatioRecord,
    ShapeRef,
    SpaceRef,
)
from autotune.records._file import JsonValue, StudyFileModel, write_atomic, write_text_atomic
from autotune.records._study import StudyFile

__all__ = [
    "BaselineRecord",
    "BestFile",
    "CapacityDeclared",
    "EngineRef",
    "GpusNeeded",
    "JsonValue",
    "ObjectiveRecord",
    "ParetoPoint",
    "RatioRecord",
    "ShapeRef",
    "SpaceRef",
    "StudyFile",
    "StudyFileModel",
    "write_atomic",
    "write_text_atomic",
]
