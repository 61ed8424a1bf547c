"""Before trial 0: the shape must fit the context (pure parts; no server). (the pure part: no server, no subprocess; the rest is tests/integration/test_preflight.py)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.errors import ShapeError, SpaceError
from autotune.space import load_space
from autotune.study import check_context
from autotune.traffic import (
    LoadSpec,
    TrafficShape,
    clip_shape,
    constant_shape,
    context_overflow,
    load_shape,
)
from tests._preflight import REPO, _package


def _model(tmp: Path, ctx: int) -> Path:
    (tmp / "config.json").write_text(json.dumps({"vocab_size": 64,
                                                 "max_position_embeddings": ctx}))
    return tmp


def test_azure_conv_does_not_fit_the_cpu_space_and_says_how_to_fix(tmp_path: Path) -> None:
    space = load_space(REPO / "search_spaces" / "cpu.yaml")  # --max-model-len 2048
    shape = load_shape(REPO / "traffic" / "azure-conv.json")
    with pytest.raises(ShapeError) as e:
        check_context(space, shape, _model(tmp_path, 4096))
    msg = str(e.value)
    assert "\n" not in msg and "2048-token context" in msg and "the model allows 4096" in msg
    assert "autotune shape clip azure-conv --max-total-tokens 2048" in msg  # no file given
    with pytest.raises(ShapeError) as e:
        check_context(space, shape, _model(tmp_path, 4096), shape_path="traffic/azure-conv.json")
    assert ("autotune shape clip traffic/azure-conv.json --max-total-tokens 2048 -o "
            "azure-conv-2048.json (then tune with --shape azure-conv-2048.json)") in str(e.value)
    # the suggested fix works: the clipped shape fits
    clipped = clip_shape(shape, max_input_tokens=2048 - 601, max_output_tokens=601)
    assert check_context(space, clipped, _model(tmp_path, 4096)) == []


def test_space_context_above_the_models_is_refused(tmp_path: Path) -> None:
    space = load_space(REPO / "search_spaces" / "cpu.yaml")
    shape = constant_shape(100, 10, name="c", load=LoadSpec(mode="closed", concurrency=1))
    with pytest.raises(SpaceError, match=r"above the model's context.*1024"):
        check_context(space, shape, _model(tmp_path, 1024))


def test_a_few_long_requests_are_a_warning(tmp_path: Path) -> None:
    shape = load_shape(REPO / "traffic" / "azure-conv.json")
    over, n, longest = context_overflow(shape, context=8192)
    assert 0 < over / n <= 0.05 and longest > 8192
    (tmp_path / "s.yaml").write_text(
        (REPO / "search_spaces" / "cpu.yaml").read_text().replace('"2048"', '"8192"'))
    big = load_space(tmp_path / "s.yaml")
    lines = check_context(big, shape, _model(tmp_path, 8192))
    assert len(lines) == 1 and "clipped to fit" in lines[0]


def test_clip_scales_lengths_and_rate() -> None:
    shape = load_shape(REPO / "traffic" / "azure-conv.json")
    half = clip_shape(shape, scale_lengths=0.5, rate_scale=0.25)
    assert half.input_tokens.p50 == pytest.approx(shape.input_tokens.p50 / 2, abs=1)
    assert half.load.time_scale == pytest.approx(4.0)
    assert half.fingerprint != shape.fingerprint and half.name == "azure-conv-clipped"
    rate_only = clip_shape(shape, rate_scale=2.0)
    assert rate_only.fingerprint == shape.fingerprint and rate_only.load.time_scale == 0.5
    with pytest.raises(ShapeError):
        clip_shape(shape, scale_lengths=0.0)


def test_clip_scales_prompts_only_and_their_shared_prefixes() -> None:
    shape = load_shape(REPO / "traffic" / "mooncake-conv.json")
    small = clip_shape(shape, scale_input=0.0625)
    assert small.input_tokens.p50 == pytest.approx(shape.input_tokens.p50 / 16, abs=1)
    assert small.output_tokens == shape.output_tokens  # outputs keep their lengths
    assert shape.prefix is not None and small.prefix is not None
    assert small.prefix.shared_prefix_tokens is not None
    assert shape.prefix.shared_prefix_tokens is not None
    assert small.prefix.shared_prefix_tokens.p50 == pytest.approx(
        shape.prefix.shared_prefix_tokens.p50 / 16, abs=1)
    # no cap: the cacheable share stays; the hash block scales with the prompts
    assert small.prefix.shared_token_fraction == shape.prefix.shared_token_fraction
    assert small.prefix.block_tokens == 32
    assert small.fingerprint != shape.fingerprint
    out_only = clip_shape(shape, scale_output=0.5)
    assert out_only.input_tokens == shape.input_tokens
    assert out_only.output_tokens.p50 == pytest.approx(shape.output_tokens.p50 / 2, abs=1)
    with pytest.raises(ShapeError, match="scale_input"):
        clip_shape(shape, scale_input=-1.0)


def _but_the_prefix_fit(shape: TrafficShape) -> dict[str, object]:
    """A shape's fields but its fingerprint and the prefix sections' hash block and
    cacheable share: traffic/mooncake-conv-2k.json predates clip's scaling of the block and
    recomputing of the share (CHANGELOG says how to regenerate it); it stays as committed
    because studies and records find it by its fingerprint."""
    d = shape.model_dump()
    d.pop("fingerprint")
    for p in (d.get("prefix"), (d.get("sessions") or {}).get("shared_prefix")):
        if p:
            p.pop("block_tokens")
            p.pop("shared_token_fraction")
    return d


@pytest.mark.parametrize(("name", "argv"), [
    ("azure-conv-2k", ["traffic/azure-conv.json", "--max-total-tokens", "2048"]),
    ("mooncake-conv-2k", ["traffic/mooncake-conv.json", "--scale-input", "0.0625",
                          "--max-total-tokens", "2048"]),
])
def test_committed_2k_shapes_regenerate_from_their_documented_commands(
        tmp_path: Path, name: str, argv: list[str]) -> None:
    """traffic/README.md's commands give the committed shapes exactly, and they fit the
    stand-in's 2048-token context (search_spaces/hybrid-mtp.yaml)."""
    from autotune.cli import main

    out = tmp_path / f"{name}.json"
    assert main(["shape", "clip", str(REPO / argv[0]), *argv[1:], "--name", name,
                 "-o", str(out)]) == 0
    new, old = load_shape(out), load_shape(REPO / "traffic" / f"{name}.json")
    assert _but_the_prefix_fit(new) == _but_the_prefix_fit(old)
    if new.prefix is not None and new.prefix.block_tokens is not None:
        assert new.prefix.block_tokens == 32  # Mooncake's 512-token block at 1/16
    assert f"autotune shape clip {' '.join(argv)} --name {name}" in (
        REPO / "traffic" / "README.md").read_text()
    assert context_overflow(load_shape(out), context=2048)[0] == 0


def test_bytecode_warns_when_no_pyc_and_python_writes_none(tmp_path: Path) -> None:
    import compileall

    from autotune.study import check_bytecode

    pkg = _package(tmp_path)
    [w] = check_bytecode(package_dir=pkg, dont_write=True)
    assert "\n" not in w and "PYTHONDONTWRITEBYTECODE" in w
    assert f"-m compileall -q -j 0 {tmp_path}" in w  # the fix, for the folder holding it
    assert check_bytecode(package_dir=pkg, dont_write=False) == []  # the first start writes
    assert compileall.compile_dir(str(pkg), quiet=1)  # the fix the warning gives
    assert check_bytecode(package_dir=pkg, dont_write=True) == []


def test_a_model_without_vocab_size_says_where_to_add_it(tmp_path: Path) -> None:
    from autotune.errors import ConfigError
    from autotune.study import check_vocab_size

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError) as info:
        check_vocab_size(tmp_path)
    text = str(info.value)
    assert text.startswith(f"--model {tmp_path}: {tmp_path / 'config.json'} has no vocab_size")
    assert 'add "vocab_size": N' in text and "tokenizer" in text
    # a model autotune generated records the value: the message gives it
    (tmp_path / "autotune-model.json").write_text(json.dumps({"vocab_size": 1000}))
    with pytest.raises(ConfigError, match=r'add "vocab_size": 1000: .*autotune-model.json'):
        check_vocab_size(tmp_path)
    # present at the top or in text_config (a multimodal model): nothing to say
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 64}}))
    check_vocab_size(tmp_path)


def test_best_refuses_a_config_whose_context_misses_more_than_a_few_prompts() -> None:
    # issue 66: `best --shape` printed a serve command (exit 0, a warning) for a shape whose
    # prompts did not fit the winner's context; the median request fitted
    from autotune.deploy import check_fit

    shape = load_shape(REPO / "traffic" / "azure-conv.json")
    over, n, _ = context_overflow(shape, context=2048)
    assert over / n > 0.05 and shape.input_tokens.p50 + shape.output_tokens.p50 <= 2048
    fit = check_fit(shape, 2048, "--max-model-len 2048", "traffic/azure-conv.json")
    assert not fit.ok and "cannot serve this traffic" in fit.message
    assert ("autotune shape clip traffic/azure-conv.json --max-total-tokens 2048 -o "
            "azure-conv-2048.json") in fit.message
    # a few long prompts still fit the config: a warning, not a refusal
    assert check_fit(shape, 8192, "--max-model-len 8192").ok
