"""The tuned fused-MoE file never serves a token count with a far-away count's tiles (guard (the pure part: no server, no subprocess; the rest is tests/integration/test_kernels_guard.py)"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from autotune.kernels import (
    KernelTimer,
    MoeShape,
    MoeTuneSettings,
    SearchSettings,
    canonical,
    default_boundaries,
    default_config,
    guard_grid,
    guard_keys,
    kept_default_reason,
    search_size,
    tune_moe,
    with_guard_keys,
    write_moe_config,
)
from tests._kernels import CASESTUDY, NANO, STAND_IN
from tests._kernels_guard import TRAFFIC, TUNED


def vllm_pick(configs: Mapping[int, dict[str, int]], m: int) -> dict[str, int]:
    """vLLM's lookup (try_get_optimal_moe_config): the nearest key, the smaller on a tie
    (the file's keys are sorted and min keeps the first)."""
    return configs[min(sorted(configs), key=lambda k: abs(k - m))]


def test_the_grid_is_vllms_batch_sizes_then_geometric() -> None:
    assert guard_grid(8192) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536,
                                2048, 3072, 4096, 6144, 8192]
    assert guard_grid(9000)[-3:] == [6144, 8192, 12288]  # up to the first size past it
    assert guard_grid(20000)[-3:] == [12288, 16384, 24576]
    assert guard_grid(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]


def test_guard_keys_hold_the_defaults_boundaries_and_the_grid() -> None:
    ends = default_boundaries(NANO, 24576)
    # block_m after 32, 96, 512; BLOCK_N/K after 64; warps after 128; stages after 32;
    # GROUP_SIZE_M once M // E > 128 (E=128: from 16512)
    assert ends == [1, 32, 33, 64, 65, 96, 97, 128, 129, 512, 513, 16511, 16512, 24576]
    for m in ends[1:-1]:  # found by scanning default_config: each end is where it changes
        assert (default_config(m, NANO) != default_config(m + 1, NANO)
                or default_config(m, NANO) != default_config(m - 1, NANO))
    # a shape with fewer experts moves the group threshold: it is scanned, not hard-coded
    small = MoeShape(experts=8, intermediate=1024, hidden=2048, topk=2)
    assert {1031, 1032} <= set(default_boundaries(small, 2048))
    guards = guard_keys(NANO, limit=20000, tuned=TRAFFIC)
    assert set(ends) - set(TRAFFIC) <= set(guards)
    assert set(guard_grid(20000)) - set(TRAFFIC) <= set(guards)
    assert not set(guards) & set(TRAFFIC)  # a tuned count is never a guard
    assert all(cfg == default_config(m, NANO) for m, cfg in guards.items())


def test_guard_keys_never_displace_tuned_keys_and_reach_the_chunk_size() -> None:
    configs, guards = with_guard_keys(TUNED, NANO, limit=8192)
    assert all(configs[m] == TUNED[m] for m in TRAFFIC)
    assert set(configs) == set(TRAFFIC) | set(guards) and not set(guards) & set(TRAFFIC)
    assert {1, 33, 65, 97, 129, 513, 4096, 6144} <= set(guards)
    # the guards reach past the largest tuned count and the chunk size
    _, guards = with_guard_keys({32: TUNED[32]}, NANO, limit=16384)
    assert max(guards) == 16384
    _, guards = with_guard_keys({20000: TUNED[8192]}, NANO)
    assert max(guards) == 24576 and {16511, 16512} <= set(guards)


def test_vllms_lookup_serves_far_counts_their_default_and_near_counts_the_tuned() -> None:
    configs, _ = with_guard_keys(TUNED, NANO, limit=8192)
    # measured on the H200 without guard keys: M=1 got key 32's tiles (0.947x), M=4608 key
    # 1024's (BLOCK_SIZE_M 64, 4 warps: 0.877x)
    assert vllm_pick(TUNED, 1) == TUNED[32] and vllm_pick(TUNED, 4608) == TUNED[1024]
    assert vllm_pick(configs, 1) == default_config(1, NANO)
    assert vllm_pick(configs, 4608) == default_config(4608, NANO)
    for m, key in [(30, 32), (62, 64), (250, 256), (540, 544), (570, 576), (1000, 1024),
                   (1100, 1024), (8000, 8192), (8192, 8192)]:
        assert vllm_pick(configs, m) == TUNED[key], m
    # every M: its own default, or the tuned config of a key whose default is M's default
    # (a tuned config never crosses a threshold of vLLM's default)
    key_of = {json.dumps(c, sort_keys=True): k for k, c in TUNED.items()}
    for m in range(1, 9000):
        got = vllm_pick(configs, m)
        k = key_of.get(json.dumps(got, sort_keys=True))
        if k is None:
            assert got == default_config(m, NANO), m
        else:
            assert default_config(k, NANO) == default_config(m, NANO), (m, k)


def gain_timer(ratios: Mapping[int, float]) -> KernelTimer:
    """Every config but vLLM's default runs in 100 us; the default in 100 x the ratio
    given for that M (1.0 unless given)."""
    def timer(config: dict[str, int], m: int, *, iters: int) -> float:
        default = canonical(default_config(m, NANO), m, NANO)
        if config == default:
            return 100.0 * ratios.get(m, 1.0)
        return 100.0
    return timer


def test_kept_default_reason_reads_the_measured_speedup() -> None:
    assert kept_default_reason(1.02, 0.03) == "1.020x below --min-gain 3%"
    assert kept_default_reason(1.03, 0.03) is None  # at the threshold the winner goes in
    assert kept_default_reason(1.14, 0.03) is None
    assert kept_default_reason(None, 0.03) is None  # no default time: nothing to compare
    assert kept_default_reason(1.02, 0.0) is None
    assert kept_default_reason(1.04, 0.05) == "1.040x below --min-gain 5%"
    assert kept_default_reason(1.02999, 0.03) == "1.029x below --min-gain 3%"  # not "1.030x"


def test_min_gain_keeps_the_default_at_1_02x_and_takes_the_winner_at_1_14x() -> None:
    timer = gain_timer({64: 1.02, 768: 1.14})
    s = SearchSettings(trials=6, recheck=1)
    small = search_size(64, NANO, timer, settings=s)
    assert small.best != small.default and small.speedup == pytest.approx(1.02, abs=1e-3)
    assert small.kept_default == "1.020x below --min-gain 3%" and small.chosen == small.default
    assert small.summary()["speedup"] == small.speedup  # the measured gain is reported
    assert small.summary()["kept_default"] == small.kept_default
    big = search_size(768, NANO, timer, settings=s)
    assert big.speedup == pytest.approx(1.14, abs=1e-3)
    assert big.kept_default is None and big.chosen == big.best != big.default
    # --min-gain 0: any winner goes in, as before
    zero = search_size(64, NANO, timer,
                       settings=SearchSettings(trials=6, recheck=1, min_gain=0.0))
    assert zero.kept_default is None and zero.chosen == zero.best


def _settings(tmp_path: Path, **kw: object) -> MoeTuneSettings:
    # 32 streams of the case study at MTP 0 and 1: 32, 64, 544, 576 and 8192 tokens
    return MoeTuneSettings(model=STAND_IN, shape=CASESTUDY, out=tmp_path / "o", trials=6,
                           recheck=1, concurrency=32, mtp_depths=(0, 1), **kw)  # type: ignore[arg-type]


def test_the_file_holds_the_default_below_min_gain_and_the_results_say_so(
        tmp_path: Path) -> None:
    timer = gain_timer({64: 1.02, 544: 1.14, 576: 1.14, 8192: 1.0301})
    res = tune_moe(_settings(tmp_path), timers=[timer], gpu_name="NVIDIA H200")
    data = {int(k): v for k, v in json.loads(res.path.read_text()).items()}
    meta = json.loads(res.results_path.read_text())
    rows = {r["m"]: r for r in meta["sizes"]}
    assert meta["min_gain"] == 0.03 and meta["settings"]["min_gain"] == 0.03
    assert rows[64]["kept_default"] == "1.020x below --min-gain 3%"
    assert rows[64]["speedup"] == pytest.approx(1.02, abs=1e-3)  # measured, not 1.0
    assert data[64] == default_config(64, NANO) and rows[64]["best"] != data[64]
    for m in (544, 576, 8192):
        assert rows[m]["kept_default"] is None and data[m] == rows[m]["best"], m
    assert data[32] == default_config(32, NANO)  # the default won its re-check: no note
    assert rows[32]["kept_default"] is None
    # guard keys hold vLLM's default and have no row: the next run does not take them for
    # tuned counts
    assert meta["guard_keys"] and not set(meta["guard_keys"]) & set(rows)
    assert all(data[g] == default_config(g, NANO) for g in meta["guard_keys"])
    calls: list[int] = []

    def counting(config: dict[str, int], m: int, *, iters: int) -> float:
        calls.append(m)
        return 1.0

    # another --min-gain decides again from the recorded times: nothing is timed
    again = tune_moe(_settings(tmp_path, min_gain=0.01), timers=[counting],
                     gpu_name="NVIDIA H200")
    assert calls == [] and again.reused == [32, 64, 544, 576, 8192]
    data = {int(k): v for k, v in json.loads(again.path.read_text()).items()}
    assert data[64] == rows[64]["best"] and data[64] != default_config(64, NANO)
    meta = json.loads(again.results_path.read_text())
    assert {r["m"]: r["kept_default"] for r in meta["sizes"]}[64] is None
    assert meta["guard_keys"] == json.loads(res.results_path.read_text())["guard_keys"]


def test_a_folder_written_before_guard_keys_is_rewritten_with_them(tmp_path: Path) -> None:
    """A study's cached folder from before this change (no guard keys, no min_gain, the
    1.02x winner in the file) is reused without timing and written again guarded."""
    res = tune_moe(_settings(tmp_path), timers=[gain_timer({64: 1.02})],
                   gpu_name="NVIDIA H200")
    meta = json.loads(res.results_path.read_text())
    for key in ("guard_keys", "min_gain"):
        del meta[key]
    del meta["search"]["min_gain"]
    for row in meta["sizes"]:
        del row["kept_default"]
    res.results_path.write_text(json.dumps(meta))
    write_moe_config(res.path, {r["m"]: r["best"] for r in meta["sizes"]})
    calls: list[int] = []

    def counting(config: dict[str, int], m: int, *, iters: int) -> float:
        calls.append(m)
        return 1.0

    again = tune_moe(_settings(tmp_path), timers=[counting], gpu_name="NVIDIA H200")
    assert calls == [] and again.reused == [32, 64, 544, 576, 8192] and again.guard_keys
    data = {int(k): v for k, v in json.loads(again.path.read_text()).items()}
    assert set(again.guard_keys) <= set(data) and data[1] == default_config(1, NANO)
    assert data[64] == default_config(64, NANO)  # 1.02x: below --min-gain now


def test_the_studys_progress_note_says_when_the_default_is_kept(tmp_path: Path) -> None:
    from autotune.kernels._study import bind_tuned_kernels
    from autotune.space import ModelFacts
    from tests._kernels import _bind_kw, _space

    space = _space(ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90"))
    notes: list[str] = []
    kw = _bind_kw(tmp_path, gain_timer({64: 1.02}))
    bind_tuned_kernels(space, note=notes.append, concurrency=32, **kw)  # type: ignore[arg-type]
    line = next(n for n in notes if n.startswith("fused-MoE M=64 ("))
    assert "1.02x the default (kept the default: 1.020x below --min-gain 3%)" in line
