"""``autotune tune --config FILE`` and ``--print-config``: keys, precedence, errors (the real
parser; no study is run)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from autotune.cli import build_parser, main
from autotune.cli._tune import settings_from_args as _settings
from autotune.errors import ConfigError


def _args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args


def test_file_sets_every_kind_of_option_and_flags_override(tmp_path: Path) -> None:
    cfg = tmp_path / "study.yaml"
    cfg.write_text(
        "model: models/tiny\nshape: traffic/x.json\nspace: search_spaces/cpu.yaml\n"
        "trials: 12\nslo: {ttft_p99: 2.0, tpot_p99: 0.05}\nno-baseline: true\n"
        "start-timeout: 90\nrequest_timeout_s: 30\nuse_ray: false\nsampler: random\n"
        "enqueue:\n  - {max_num_seqs: 32}\n  - '{\"max_num_seqs\": 64}'\nseed: 4\n"
    )
    s = _settings(_args(["tune", "--config", str(cfg), "--trials", "20", "--seed=9"]))
    assert s.trials == 20 and s.seed == 9  # flags win, even one equal to the default
    assert s.model == Path("models/tiny") and s.space == Path("search_spaces/cpu.yaml")
    assert s.measure.slo == {"ttft_p99": 2.0, "tpot_p99": 0.05}
    assert s.baseline is False and s.use_ray is False and s.sampler == "random"
    assert s.measure.start_timeout_s == 90.0 and s.measure.request_timeout_s == 30.0
    assert s.enqueue == [{"max_num_seqs": 32}, {"max_num_seqs": 64}]


@pytest.mark.parametrize(("text", "message"), [
    ("trails: 3\n", "unknown key 'trails'; did you mean 'trials'?"),
    ("frobnicate: 1\n", "unknown key 'frobnicate' (the keys are the flags"),
    ("sampler: bayes\n", "'sampler': 'bayes' is not one of tpe, random"),
    ("trials: many\n", "'trials': 'many' is not a valid int"),
    ("baseline: maybe\n", "'baseline' must be true or false"),
    ("- trials\n", "must be a mapping"),
    ("trials: [3\n", "not valid YAML"),
    ("trials: 3\nno_baseline: true\nbaseline: true\n", "set the same option"),
])
def test_bad_files_are_one_line_errors_naming_the_key(tmp_path: Path, text: str,
                                                      message: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: m\nshape: s\nspace: p\n" + text
                   if not text.startswith("-") else text)
    with pytest.raises(ConfigError) as err:
        _settings(_args(["tune", "--config", str(cfg)]))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(cfg) in str(err.value)


def test_required_options_may_come_from_the_file_or_flags(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    assert main(["tune", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert "--shape, --space are required" in err and "--config" in err
    assert main(["tune", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["tune", "--model", "models/tiny", "--shape", "s.json", "--space", "p.yaml",
            "--trials", "7", "--slo", "ttft_p99=2", "--no-baseline",
            "--enqueue", '{"max_num_seqs": 8}', "--timeout", "600"]
    assert main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "trials: 7" in text and "baseline: false" in text and "# false = --no-baseline" in text
    assert "# tracking_uri: null" in text  # unset options are there, commented out
    cfg = tmp_path / "study.yaml"
    cfg.write_text(text)
    again = _settings(_args(["tune", "--config", str(cfg)]))
    assert again == _settings(_args(argv))
    # a fresh starting file (nothing given) loads too, once the required keys are filled
    assert main(["tune", "--print-config"]) == 0
    blank = capsys.readouterr().out
    assert "model: null" in blank and "# study_name: null" in blank
    cfg.write_text(blank.replace("model: null", "model: m").replace("shape: null", "shape: s")
                   .replace("space: null", "space: p"))
    assert _settings(_args(["tune", "--config", str(cfg)])).trials == 20


def test_a_saved_settings_dump_is_a_valid_config(tmp_path: Path) -> None:
    import yaml

    s = _settings(_args(["tune", "--model", "m", "--shape", "s", "--space", "p",
                         "--slo", "e2e_p99=9", "--timeout", "60", "--no-ray"]))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(s.model_dump(mode="json")))
    assert _settings(_args(["tune", "--config", str(cfg)])) == s
