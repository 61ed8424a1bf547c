"""Shape comparison: verdicts, per-dimension distances, the scalar distance."""

from __future__ import annotations

import dataclasses

import numpy as np

from autotune.traffic import (
    THRESHOLDS,
    LoadSpec,
    TraceRecords,
    TrafficShape,
    constant_shape,
    diff_shapes,
    fit_shape,
)


def test_azure_vs_mooncake_drifted(azure_shape: TrafficShape, mooncake_shape: TrafficShape) -> None:
    d = diff_shapes(azure_shape, mooncake_shape)
    assert d.verdict == "drifted" and d.distance > 1
    assert {"input_tokens", "output_tokens", "rate", "burstiness"} <= set(d.drifted_dimensions)
    assert d.dimensions["input_tokens"].detail["ks"] > 0.5
    # prefix statistics exist on one side only: not measurable, so not a reason to drift
    assert d.dimensions["prefix_sharing"].distance is None
    out = d.to_dict()
    assert out["verdict"] == "drifted" and set(out["dimensions"]) == set(THRESHOLDS)


def test_self_is_same(azure_shape: TrafficShape) -> None:
    d = diff_shapes(azure_shape, azure_shape)
    assert d.verdict == "same" and d.distance == 0 and d.drifted_dimensions == []


def _scaled(records: TraceRecords, *, inp: float = 1.0, time: float = 1.0) -> TraceRecords:
    return dataclasses.replace(
        records,
        input_tokens=np.maximum(1, np.rint(records.input_tokens * inp)).astype(np.int64),
        timestamps_s=records.timestamps_s * time,
    )


def test_one_dimension_drifts(azure_records: TraceRecords, azure_shape: TrafficShape) -> None:
    longer = fit_shape(_scaled(azure_records, inp=1.5))
    d = diff_shapes(azure_shape, longer)
    assert d.drifted_dimensions == ["input_tokens"]
    slower = fit_shape(_scaled(azure_records, time=2.0))
    assert "rate" in diff_shapes(azure_shape, slower).drifted_dimensions
    slightly = fit_shape(_scaled(azure_records, inp=1.03))
    assert diff_shapes(azure_shape, slightly).verdict == "same"


def test_distance_ranks_the_nearest_shape(
    azure_records: TraceRecords, azure_shape: TrafficShape
) -> None:
    candidates = [fit_shape(_scaled(azure_records, inp=f)) for f in (3.0, 1.1, 1.5)]
    distances = [diff_shapes(azure_shape, c).distance for c in candidates]
    assert int(np.argmin(distances)) == 1
    assert distances[1] < distances[2] < distances[0]


def test_constant_shapes() -> None:
    load = LoadSpec(mode="closed", concurrency=4, requests=8)
    a = constant_shape(512, 512, load=load)
    assert diff_shapes(a, constant_shape(512, 512, load=load)).verdict == "same"
    d = diff_shapes(a, constant_shape(512, 128, load=load))
    assert d.drifted_dimensions == ["output_tokens"]
    assert d.dimensions["output_tokens"].detail["ks"] == 1.0
    assert d.dimensions["rate"].distance is None
