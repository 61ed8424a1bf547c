"""One home for the per-trial measurement settings (:class:`MeasureSettings`): its defaults
are what ``tune`` and ``bench`` show and use, flat keys still build a study's settings,
bench validates its options through it, and the trial it builds survives a pickle (a Ray
worker's copy)."""

from __future__ import annotations

import argparse
import json
import pickle
import re
from pathlib import Path

import pytest

from autotune.cli import build_parser, main
from autotune.cli._bench import bench_spec, parse_bench
from autotune.cli._tune import settings_from_args, tune_parser
from autotune.config import DEFAULT_CACHE_DIR, MEASURE_KEYS, MeasureSettings, TuneSettings
from autotune.measure import SegmentRule
from tests.conftest import REPO

SHAPE = REPO / "traffic" / "example-chat.json"
OPEN = REPO / "traffic" / "azure-conv-2k.json"  # recorded arrivals


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 64}))
    return d


def _bench_parser() -> argparse.ArgumentParser:
    sub = build_parser()._subparsers
    assert sub is not None
    action = next(a for a in sub._group_actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["bench"]  # type: ignore[no-any-return]


def _measure_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest in MEASURE_KEYS}


def _help_default(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """The last "(default: X)" that ``--help`` shows in ``flag``'s entry (None: none)."""
    lines = parser.format_help().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"  {flag}\b", line))
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"  -", lines[i]) or not lines[i].strip()), len(lines))
    found = re.findall(r"\(default: ([^)]*)\)", " ".join(x.strip() for x in lines[start:end]))
    return found[-1] if found else None


def test_tune_and_bench_take_every_measurement_setting_from_the_one_model() -> None:
    defaults = MeasureSettings()
    tune, bench = tune_parser(), _bench_parser()
    assert set(_measure_actions(tune)) == set(_measure_actions(bench)) == MEASURE_KEYS
    for name, action in _measure_actions(tune).items():
        want = getattr(defaults, name)
        bench_action = _measure_actions(bench)[name]
        assert action.option_strings == bench_action.option_strings, name
        assert action.help == bench_action.help, name  # one description
        assert action.default == want or (want == {} and action.default is None), name
        # bench's --output-jitter is unset until given (--no-stagger then sets 0)
        assert bench_action.default == action.default or name == "output_jitter", name
        shown = _help_default(tune, action.option_strings[0])
        if want not in (None, {}):  # (a default of None: the text says what it means)
            assert shown == str(want), name
        assert _help_default(bench, action.option_strings[0]) == shown, name
    # the segment rule's settings are the same defaults
    rule = SegmentRule()
    assert SegmentRule.of(defaults) == rule
    assert (rule.precision, rule.warmup_tolerance, rule.warmup_max_s, rule.min_segments,
            rule.measure_max_s) == (defaults.precision, defaults.warmup_tolerance,
                                    defaults.warmup_max_s, defaults.min_segments,
                                    defaults.measure_max_s)


def test_a_bench_and_a_study_with_no_options_measure_alike(model: Path) -> None:
    from autotune.space import LaunchSpec
    from autotune.study import TrialTemplate
    from autotune.traffic import load_shape

    bench = bench_spec(parse_bench(["--model", str(model), "--shape", str(SHAPE)]))
    settings = settings_from_args(tune_parser().parse_args(
        ["--model", str(model), "--shape", str(SHAPE), "--space", "x.yaml"]))
    study = TrialTemplate(model=str(model), shape=load_shape(SHAPE)).spec(
        0, LaunchSpec(), settings, probe=False)
    assert bench.measure == study.measure
    assert bench.measure.cache_dir == DEFAULT_CACHE_DIR.expanduser()  # resolved, one default
    assert bench.measure.model_copy(update={"cache_dir": None}) == MeasureSettings()


def test_flat_keys_still_build_the_nested_settings() -> None:
    base = {"model": "m", "shape": "s.json", "space": "x.yaml"}
    flat = TuneSettings(**base, precision=0.05, repeats=3, slo={"ttft_p99": 1.0})  # type: ignore[arg-type]
    nested = TuneSettings(**base, measure={"precision": 0.05, "repeats": 3,  # type: ignore[arg-type]
                                           "slo": {"ttft_p99": 1.0}})
    assert flat == nested
    assert flat.measure == MeasureSettings(precision=0.05, repeats=3, slo={"ttft_p99": 1.0})
    # written flat (config.yaml, study.json, a study's stored settings), and built again
    dumped = flat.model_dump(mode="json")
    assert dumped["precision"] == 0.05 and "measure" not in dumped
    assert TuneSettings.model_validate(dumped) == flat
    with pytest.raises(ValueError, match="precision given both flat and under 'measure'"):
        TuneSettings(**base, precision=0.1, measure={"precision": 0.2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra"):
        TuneSettings(**base, measure={"precisoin": 0.2})  # type: ignore[arg-type]
    # a capacity study without SLOs judges the default ones, flat or nested
    cap = TuneSettings(**base, objective="capacity", measure=MeasureSettings())  # type: ignore[arg-type]
    assert cap.measure.slo == {"ttft_p99": 2.0, "tpot_p99": 0.1}


def test_bench_takes_warmup_tolerance_and_request_timeout(model: Path) -> None:
    spec = bench_spec(parse_bench(["--model", str(model), "--shape", str(SHAPE),
                                   "--warmup-tolerance", "0.2", "--request-timeout", "30"]))
    assert spec.measure.warmup_tolerance == 0.2 and spec.rule.warmup_tolerance == 0.2
    assert spec.measure.request_timeout_s == 30.0


@pytest.mark.parametrize("flag, value", [
    ("--warmup-tolerance", "1.5"), ("--precision", "0"), ("--repeats", "0"),
    ("--min-segments", "41"), ("--measure-max-s", "-1"), ("--warmup-max-s", "0"),
    ("--output-jitter", "1"), ("--capacity-goodput", "2"), ("--request-timeout", "0"),
])
def test_bench_refuses_an_out_of_range_option_in_one_line(
        model: Path, flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", str(model), "--shape", str(SHAPE), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"autotune: error: {flag} "), err


def test_a_trial_spec_round_trips_through_pickle(model: Path) -> None:
    closed = bench_spec(parse_bench(["--model", str(model), "--shape", str(SHAPE),
                                     "--precision", "0.05", "--slo", "ttft_p99=1.5"]))
    cap = bench_spec(parse_bench(["--model", str(model), "--shape", str(OPEN), "--capacity",
                                  "--capacity-max-levels", "4"]), number=1)
    for spec in (closed, cap):
        again = pickle.loads(pickle.dumps(spec))
        assert again == spec and again.measure == spec.measure and again.slo == spec.slo
    assert closed.slo is not None and closed.slo.ttft_s == 1.5
    assert cap.capacity is not None and cap.capacity.max_levels == 4
    assert cap.measure.slo == {"ttft_p99": 2.0, "tpot_p99": 0.1}  # the capacity defaults


def test_the_shape_is_read_once_on_the_way_to_the_study(tmp_path: Path) -> None:
    """The command line resolves the study once (shape read, objective resolved); what it
    hands on needs the file no more."""
    import shutil

    from autotune.study import resolve_study
    from autotune.traffic import load_shape

    shape = tmp_path / "shape.json"
    shutil.copy(OPEN, shape)
    resolved = resolve_study(TuneSettings(model=Path("m"), shape=shape, space=Path("x.yaml")))
    shape.unlink()
    assert resolve_study(resolved) is resolved
    assert resolved.settings.objective == "capacity"  # auto, from the recorded arrivals
    assert resolved.settings.measure.slo == {"ttft_p99": 2.0, "tpot_p99": 0.1}
    assert resolved.shape == load_shape(OPEN)
