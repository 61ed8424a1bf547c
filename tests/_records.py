"""A :class:`~autotune.records.BestFile` from the few fields a test cares about: the
fields every best.json holds (model, flags, the objective's name and metric) filled in."""

from __future__ import annotations

from typing import Any

from autotune.records import BestFile


def best_file(kind: str = "throughput", /, **fields: Any) -> BestFile:
    """A best.json of ``fields`` for an objective of ``kind`` (``objective``: a dict merged
    into its objective record)."""
    metric = {"capacity": "capacity_rps", "goodput": "goodput_rps"}.get(
        kind, "output_tokens_per_s")
    doc: dict[str, Any] = {"model": "m", "flags": [], "trial": 0, **fields}
    doc["objective"] = {"name": kind, "metric": metric, **dict(fields.get("objective") or {})}
    cap = doc.get("capacity")
    if isinstance(cap, dict):
        doc["capacity"] = {"capacity_rps": doc["objective"].get("value", 0.0), **cap}
    return BestFile.model_validate(doc)
