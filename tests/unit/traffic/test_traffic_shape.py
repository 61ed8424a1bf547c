"""Fitting, fingerprints, the shape file and the committed example shapes."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from autotune.errors import AutotuneError, ShapeError, TrafficError
from autotune.traffic import (
    LoadSpec,
    TraceRecords,
    TrafficShape,
    compute_fingerprint,
    constant_shape,
    diff_shapes,
    fit_shape,
    load_shape,
    read_trace,
    save_shape,
)

REPO = Path(__file__).resolve().parents[3]


def test_azure_shape_matches_sources(azure_shape: TrafficShape) -> None:
    s = azure_shape
    # the sample: the recording's first 600 s (tests/data/traces/SOURCES.md)
    assert s.requests == 2867
    assert s.duration_s == pytest.approx(599.97, abs=0.005)
    assert s.rate_rps == pytest.approx(4.7786, abs=0.0001)
    assert (
        s.input_tokens.mean,
        s.input_tokens.p50,
        s.input_tokens.p99,
        s.input_tokens.max,
    ) == pytest.approx((1146.63, 1041, 4106.34, 7930), abs=0.01)
    assert (
        s.output_tokens.mean,
        s.output_tokens.p50,
        s.output_tokens.p99,
        s.output_tokens.max,
    ) == pytest.approx((260.27, 217, 620.02, 1000), abs=0.01)
    assert s.arrivals is not None
    assert s.arrivals.interarrival_cv == pytest.approx(1.103, abs=0.0005)
    # over the full 60-s windows only: where a recording stops must not matter
    assert s.arrivals.dispersion_60s == pytest.approx(7.2621, abs=0.0001)
    assert s.concurrency is not None and s.concurrency.method == "assumed_latency"
    assert s.prefix is None
    assert len(s.input_tokens.quantiles) == 101
    assert s.load.mode == "open" and s.load.requests == 1000


def test_mooncake_shape_matches_sources(mooncake_shape: TrafficShape) -> None:
    s = mooncake_shape
    # the sample: the recording's first 300 s
    assert s.rate_rps == pytest.approx(3.0909, abs=0.0001)
    assert (s.input_tokens.mean, s.input_tokens.p50, s.input_tokens.max) == pytest.approx(
        (13_557.8, 8353, 121_924), abs=0.01
    )
    assert s.input_tokens.p99 == pytest.approx(88_073.4, abs=0.01)
    assert (
        s.output_tokens.mean,
        s.output_tokens.p50,
        s.output_tokens.p99,
        s.output_tokens.max,
    ) == pytest.approx((352.789, 367.5, 998.2, 2000), abs=0.01)
    a = s.arrivals
    assert a is not None
    # quantised timestamps: most gaps are 0, the gap CV is inflated, the count measure is not
    assert a.zero_gap_fraction > 0.85
    assert a.interarrival_cv == pytest.approx(2.8745, abs=0.0001)
    # the last, partial window (57 s of 60) is left out
    assert a.dispersion_60s == pytest.approx(2.3211, abs=0.0001)
    p = s.prefix
    assert p is not None and p.source == "hash_ids"
    assert p.shared_token_fraction == pytest.approx(0.207, abs=0.001)
    assert p.shared_prefix_ratio is not None and len(p.shared_prefix_ratio) == 101


def _shuffled_copy(src: Path, dst: Path, *, header: bool) -> Path:
    lines = src.read_text(encoding="utf-8").splitlines()
    head, body = (lines[:1], lines[1:]) if header else ([], lines)
    random.Random(7).shuffle(body)
    dst.write_text("\n".join(head + body) + "\n", encoding="utf-8")
    return dst


def test_shuffled_azure_rows_same_fingerprint(
    azure_path: Path, azure_shape: TrafficShape, tmp_path: Path
) -> None:
    shuffled = _shuffled_copy(azure_path, tmp_path / "shuffled.csv", header=True)
    records = read_trace(shuffled)
    assert not records.was_sorted
    again = fit_shape(records, name="other name", load=LoadSpec(mode="closed", concurrency=3))
    assert again.fingerprint == azure_shape.fingerprint
    d = diff_shapes(azure_shape, again)
    assert d.verdict == "same" and d.distance == 0.0 and d.same_fingerprint


def test_shuffled_mooncake_rows_same_fingerprint(
    mooncake_path: Path, mooncake_shape: TrafficShape, tmp_path: Path
) -> None:
    """Mooncake has many tied timestamps and prefix ids: still order-independent."""
    shuffled = _shuffled_copy(mooncake_path, tmp_path / "shuffled.jsonl", header=False)
    again = fit_shape(read_trace(shuffled))
    assert again.fingerprint == mooncake_shape.fingerprint
    assert again.prefix == mooncake_shape.prefix
    assert diff_shapes(mooncake_shape, again).verdict == "same"


def test_fingerprint_tracks_statistics(
    azure_records: TraceRecords, azure_shape: TrafficShape
) -> None:
    fewer = dataclasses.replace(
        azure_records,
        timestamps_s=azure_records.timestamps_s[:-1],
        input_tokens=azure_records.input_tokens[:-1],
        output_tokens=azure_records.output_tokens[:-1],
    )
    assert fit_shape(fewer).fingerprint != azure_shape.fingerprint
    assert (
        azure_shape.with_load(LoadSpec(mode="closed", concurrency=1)).fingerprint
        == azure_shape.fingerprint
    )


def test_save_load_roundtrip(azure_shape: TrafficShape, tmp_path: Path) -> None:
    path = save_shape(azure_shape, tmp_path / "sub" / "a.json")
    assert load_shape(path) == azure_shape
    assert not list(path.parent.glob(".*.tmp"))  # the temp file was renamed, not left behind
    assert json.loads(path.read_text())["fingerprint"] == azure_shape.fingerprint


def test_load_shape_errors(azure_shape: TrafficShape, tmp_path: Path) -> None:
    with pytest.raises(ShapeError, match="does not exist; fit one"):
        load_shape(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ShapeError, match="line 1: not valid JSON"):
        load_shape(bad)
    data = json.loads(azure_shape.model_dump_json())
    for mutate, message in [
        (lambda d: d.update(colour="blue"), "colour: Extra inputs are not permitted"),
        (lambda d: d["input_tokens"].update(quantiles=[1.0, 2.0]), "input_tokens.quantiles"),
        (lambda d: d["output_tokens"].update(mean=float("nan")), "output_tokens.mean"),
        (lambda d: d.update(version=99), "newer than this autotune"),
        (lambda d: d["load"].update(mode="closed"), "needs 'concurrency'"),
        (lambda d: d["input_tokens"].update(mean=5.0), "does not match its statistics"),
    ]:
        d = json.loads(json.dumps(data))
        mutate(d)
        bad.write_text(json.dumps(d))
        with pytest.raises(ShapeError, match=message):
            load_shape(bad)


def test_constant_shape() -> None:
    s = constant_shape(512, 512, load=LoadSpec(mode="closed", concurrency=256, requests=2560))
    assert s.input_tokens.quantiles == [512.0] * 101 and s.output_tokens.std == 0
    assert s.rate_rps == 0 and s.arrivals is None and s.requests == 2560
    other = constant_shape(512, 512, load=LoadSpec(mode="closed", concurrency=1, requests=2560))
    assert other.fingerprint == s.fingerprint
    assert constant_shape(512, 256, load=s.load).fingerprint != s.fingerprint
    with pytest.raises(TrafficError, match=">= 1 token"):
        constant_shape(0, 5, load=s.load)


def test_fit_rejects_inconsistent_records() -> None:
    records = TraceRecords(
        path="mem",
        format="azure",
        timestamps_s=np.array([0.0, 1.0]),
        input_tokens=np.array([5, 0]),
        output_tokens=np.array([1, 1]),
    )
    with pytest.raises(AutotuneError, match="token counts must be >= 1"):
        fit_shape(records)
    with pytest.raises(AutotuneError, match="no requests"):
        fit_shape(
            dataclasses.replace(
                records,
                timestamps_s=np.array([]),
                input_tokens=np.array([], dtype=np.int64),
                output_tokens=np.array([], dtype=np.int64),
            )
        )


def test_single_request_has_no_rate() -> None:
    records = TraceRecords(
        path="one",
        format="openai_log",
        timestamps_s=np.array([0.0]),
        input_tokens=np.array([9]),
        output_tokens=np.array([3]),
    )
    s = fit_shape(records)
    assert s.requests == 1 and s.rate_rps == 0 and s.arrivals is None and s.correlation is None


# ------------------------------------------------------------------ committed shapes


@pytest.mark.parametrize(
    "name", ["example-chat", "azure-conv", "mooncake-conv", "casestudy-512x512"]
)
def test_committed_shapes_load(name: str) -> None:
    shape = load_shape(REPO / "traffic" / f"{name}.json")
    assert shape.name == name


def test_example_chat_is_cheap_on_a_cpu() -> None:
    s = load_shape(REPO / "traffic" / "example-chat.json")
    assert 100 <= s.input_tokens.p50 <= 150 and 30 <= s.output_tokens.p50 <= 60
    assert s.input_tokens.max <= 512 and s.output_tokens.max <= 128
    assert (s.load.mode, s.load.concurrency, s.load.requests) == ("closed", 8, 48)


def test_casestudy_shape() -> None:
    s = load_shape(REPO / "traffic" / "casestudy-512x512.json")
    assert s.input_tokens.quantiles == [512.0] * 101 == s.output_tokens.quantiles
    assert (s.load.mode, s.load.concurrency, s.load.requests) == ("closed", 256, 2560)


def test_committed_shapes_are_current() -> None:
    """traffic/make_examples.py's shapes hold the whole recordings' facts (the committed
    samples are their first minutes; ../shared/traces/SOURCES.md, where present, has the
    whole files: then a fresh fit of them must give the committed fingerprints; the
    committed Mooncake shape has no sessions section, so its fingerprint is that of a fresh
    fit without one)."""
    azure = load_shape(REPO / "traffic" / "azure-conv.json")
    mooncake = load_shape(REPO / "traffic" / "mooncake-conv.json")
    assert azure.requests == 19_366 and azure.rate_rps == pytest.approx(5.53, abs=0.005)
    assert (azure.input_tokens.mean, azure.input_tokens.max) == pytest.approx((1155, 14_050), abs=1)
    assert mooncake.rate_rps == pytest.approx(3.40, abs=0.005)
    assert mooncake.input_tokens.max == pytest.approx(126_195, abs=1)
    whole = REPO.parent / "shared" / "traces"
    if (whole / "azure2023_conv.csv").is_file():
        fresh = fit_shape(read_trace(whole / "azure2023_conv.csv"), name="azure")
        assert azure.fingerprint == fresh.fingerprint
    if (whole / "mooncake_fast25_conversation.jsonl").is_file():
        fresh = fit_shape(read_trace(whole / "mooncake_fast25_conversation.jsonl"),
                          name="mooncake")
        assert fresh.sessions is not None and mooncake.sessions is None
        without = fresh.model_copy(update={"sessions": None}).model_dump()
        assert mooncake.fingerprint == compute_fingerprint(without)
