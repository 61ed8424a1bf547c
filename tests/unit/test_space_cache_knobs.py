"""The cache and scheduling knobs of multi-turn traffic (prefix caching, KV offload, block
size, batched-token budget, long-prefill threshold): where they exist, the flags they emit,
the rules that refuse what vLLM rejects or ignores, and the parser check of a knob an
installed vLLM lacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.engine._flags import EngineSurface, check_space_flags, flag_table
from autotune.space import ModelFacts, SearchSpace, load_space
from tests._flags import SPACES

REPO = Path(__file__).resolve().parents[2]
CPU = ModelFacts(device="cpu")
GPU = ModelFacts(device="cuda", gpu_arch="sm90")
CPU_HYBRID = ModelFacts(device="cpu", hybrid=True)
GPU_HYBRID = ModelFacts(device="cuda", hybrid=True, mtp=True, gpu_arch="sm90")


def _space(name: str, facts: ModelFacts) -> SearchSpace:
    return load_space(REPO / "search_spaces" / f"{name}.yaml", facts=facts)


def _flags(name: str, facts: ModelFacts, **params: object) -> list[str]:
    space = _space(name, facts)
    full = {**space.baseline_params(), **params}
    active = {k: v for k, v in full.items() if space.is_active(k, full)}
    return list(space.launch_spec(active).flags)


def test_multiturn_is_committed_and_its_knobs_follow_the_device() -> None:
    assert "multiturn.yaml" in {p.name for p in SPACES}  # so every space-wide test covers it
    common = {"enable_prefix_caching", "block_size", "max_num_seqs", "max_num_batched_tokens",
              "long_prefill_token_threshold"}
    params = {"kv_offloading_size": 16, "block_size": 32, "enable_prefix_caching": True}
    for facts, want in ((CPU, common), (GPU, common | {"kv_offloading_size"}),
                        (CPU_HYBRID, common - {"enable_prefix_caching", "block_size"})):
        space = _space("multiturn", facts)
        assert {k for k in space.knobs if space.is_active(k, params)} == want, facts
    # the CPU build skips torch.compile (-O0); a GPU keeps vLLM's level
    assert _flags("multiturn", CPU)[-2:] == ["--optimization-level", "0"]
    assert "--optimization-level" not in _flags("multiturn", GPU)
    # a hybrid on the CPU build: prefix caching off (it crashes there), baseline included
    base = _space("multiturn", CPU_HYBRID)
    assert "--no-enable-prefix-caching" in base.launch_spec({}, baseline=True).flags


@pytest.mark.parametrize("name, facts", [("multiturn", GPU), ("dense", GPU),
                                         ("hybrid-mtp", GPU_HYBRID)])
def test_offload_backend_is_sent_only_with_a_size(name: str, facts: ModelFacts) -> None:
    on = _flags(name, facts, kv_offloading_size=64, enable_prefix_caching=True)
    i = on.index("--kv-offloading-size")
    assert on[i + 1] == "64" and on[on.index("--kv-offloading-backend") + 1] == "native"
    off = _flags(name, facts, kv_offloading_size=0)
    assert "--kv-offloading-size" not in off and "--kv-offloading-backend" not in off
    space = _space(name, facts)
    baseline = space.launch_spec(space.baseline_params(), baseline=True).flags
    assert "--kv-offloading-size" not in baseline and "--kv-offloading-backend" not in baseline


def test_offload_does_not_exist_on_the_cpu_build() -> None:
    assert not _space("multiturn", CPU).is_active("kv_offloading_size", {})
    assert "kv_offloading_size" not in _space("cpu", CPU).knobs
    assert "--kv-offloading-size" not in _flags("multiturn", CPU, kv_offloading_size=16)


_LONG = "--long-prefill-token-threshold must be below --max-num-batched-tokens"
_OFFLOAD = "with --no-enable-prefix-caching it only copies"


@pytest.mark.parametrize("name, facts, params, reason", [
    ("multiturn", CPU, {"block_size": 16}, "multiple of 32"),
    ("multiturn", CPU, {"long_prefill_token_threshold": 512, "max_num_batched_tokens": 512}, _LONG),
    ("multiturn", CPU, {"long_prefill_token_threshold": 1024, "max_num_batched_tokens": 512},
     _LONG),
    ("multiturn", CPU, {"max_num_seqs": 1024, "max_num_batched_tokens": 512}, "max-num-seqs"),
    ("multiturn", GPU, {"kv_offloading_size": 16, "enable_prefix_caching": False}, _OFFLOAD),
    ("dense", GPU, {"long_prefill_token_threshold": 2048, "max_num_batched_tokens": 2048}, _LONG),
    ("dense", GPU, {"kv_offloading_size": 64, "enable_prefix_caching": False}, _OFFLOAD),
    ("hybrid-mtp", GPU_HYBRID, {"kv_offloading_size": 16, "enable_prefix_caching": False},
     "KV offload of a hybrid model needs --enable-prefix-caching"),
    ("hybrid-mtp", GPU_HYBRID,
     {"long_prefill_token_threshold": 2048, "max_num_batched_tokens": 2048}, _LONG),
])  # fmt: skip
def test_rules_refuse_what_vllm_rejects_or_ignores(name: str, facts: ModelFacts,
                                                    params: dict[str, object], reason: str) -> None:
    space = _space(name, facts)
    bad = {**space.baseline_params(), **params}
    problems = space.violations(bad)
    assert len(problems) == 1 and reason in problems[0], problems
    assert space.violations(space.baseline_params()) == []


@pytest.mark.parametrize("name, facts, params", [
    ("multiturn", CPU, {"block_size": 32, "long_prefill_token_threshold": 256,
                        "max_num_batched_tokens": 512, "max_num_seqs": 16,
                        "enable_prefix_caching": False}),
    ("multiturn", GPU, {"block_size": 16, "kv_offloading_size": 64, "enable_prefix_caching": True,
                        "long_prefill_token_threshold": 1024, "max_num_batched_tokens": 2048}),
    ("dense", GPU, {"block_size": 64, "long_prefill_token_threshold": 0,
                    "max_num_batched_tokens": 2048, "max_num_seqs": 64}),
    ("hybrid-mtp", GPU_HYBRID, {"kv_offloading_size": 16, "enable_prefix_caching": True,
                                "long_prefill_token_threshold": 1024}),
])  # fmt: skip
def test_valid_corners_pass_and_emit_their_flags(name: str, facts: ModelFacts,
                                                  params: dict[str, object]) -> None:
    space = _space(name, facts)
    full = {**space.baseline_params(), **params}
    assert space.violations(full) == []
    flags = space.launch_spec(full).flags
    for knob, value in params.items():
        flag = space.knobs[knob].flag
        assert flag is not None
        if isinstance(value, bool):
            assert (flag if value else "--no-" + flag[2:]) in flags
        elif value == space.knobs[knob].omit_when:
            assert flag not in flags
        else:
            assert flags[flags.index(flag) + 1] == str(value)


def test_a_knob_an_older_release_lacks_is_refused_in_one_line(tmp_path: Path) -> None:
    """--max-num-partial-prefills is in vLLM 0.26 and gone from 0.27 on (hence no space
    searches it): the parser check names the knob, the flag and the version."""
    p = tmp_path / "partial.yaml"
    p.write_text("name: partial\nknobs:\n  partial:\n    type: categorical\n"
                 "    choices: [1, 2, 4]\n    flag: --max-num-partial-prefills\n")
    space = load_space(p)
    table = flag_table()
    assert check_space_flags(space, EngineSurface.from_dict(table["0.26.0"])) == []
    problems = check_space_flags(space, EngineSurface.from_dict(table["0.27.0"]))
    assert problems == [f"{p}: knob 'partial' sets --max-num-partial-prefills, which vLLM 0.27.0 "
                        "does not have; remove it, or add a rename to the translation table "
                        "(autotune/engine/_vllm.py _FLAG_RULES)"]


@pytest.mark.parametrize("version", sorted(flag_table()))
def test_every_cache_knob_is_a_flag_of_every_release(version: str) -> None:
    surface = EngineSurface.from_dict(flag_table()[version])
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--block-size",
                 "--kv-offloading-size", "--kv-offloading-backend",
                 "--max-num-batched-tokens", "--long-prefill-token-threshold"):
        # 0.33 spells --no-enable-x as --disable-x: translate_flags rewrites it
        if flag == "--no-enable-prefix-caching" and version.startswith("0.33"):
            flag = "--disable-prefix-caching"
        assert surface.has_flag(flag), (version, flag)
