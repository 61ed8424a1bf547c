"""experiments/h200-kernels/e2e.py: the end-to-end table's plan, the configs' bench
arguments as the space renders them, and the ratio tuned / default tiles with its interval
(pure logic on fake `autotune bench --json` files; no server, no GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "experiments" / "h200-kernels"
_spec = importlib.util.spec_from_file_location("h200_kernels_e2e", HERE / "e2e.py")
e2e = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(e2e)  # type: ignore[union-attr]


def test_each_pair_runs_twice_in_alternating_order() -> None:
    assert e2e.plan([32], ["defaults"]) == [
        "32 defaults plain 1", "32 defaults tuned 1", "32 defaults tuned 2",
        "32 defaults plain 2"]
    assert len(e2e.plan([32, 256], ["defaults", "recipe"])) == 16
    # every cell's first start comes before any cell's second (a budget cut leaves one each)
    assert e2e.plan([32, 256], ["defaults", "recipe"], rounds=1) == [
        "32 defaults plain 1", "32 defaults tuned 1", "32 recipe plain 1", "32 recipe tuned 1",
        "256 defaults plain 1", "256 defaults tuned 1", "256 recipe plain 1",
        "256 recipe tuned 1"]
    assert e2e.plan([32, 256], ["defaults"])[2:4] == ["256 defaults plain 1",
                                                      "256 defaults tuned 1"]
    with pytest.raises(SystemExit, match="unknown base"):
        e2e.plan([32], ["fastest"])


def test_bench_arguments_are_the_configs_a_study_runs() -> None:
    d = e2e.bench_args("defaults", 32)
    # the stand-in's simulated uniform MoE routing applies to the defaults too
    assert d == ["--env=VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random",
                 "--", "--max-model-len", "2048", "--load-format", "dummy"]
    r = e2e.bench_args("recipe", 256)
    flags = r[r.index("--") + 1:]
    assert "--env=OMP_NUM_THREADS=1" in r[:r.index("--")]
    assert "--env=VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random" in r[:r.index("--")]
    assert flags[flags.index("--mamba-backend") + 1] == "flashinfer"
    assert flags[flags.index("--max-num-seqs") + 1] == "256"
    spec = json.loads(flags[flags.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 1 and spec["synthetic_acceptance_length"] == 1.7
    # the tuned tiles are the variant's environment, never the space's moe_config knob
    assert not any("VLLM_TUNED_CONFIG_FOLDER" in a for a in d + r)


def _bench(p: Path, value: float, half: float, ok: bool = True) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"ok": ok, "start_s": 70.0, "measure_s": 75.0, "measurement": {
        "output_tokens_per_s": value, "output_tokens_per_s_ci_low": value - half,
        "output_tokens_per_s_ci_high": value + half}}))


def test_the_table_pools_both_starts_of_each_variant(tmp_path: Path) -> None:
    d = tmp_path / "e2e"
    _bench(d / "c32-defaults-plain-r1.json", 3000.0, 90.0)
    _bench(d / "c32-defaults-plain-r2.json", 3060.0, 90.0)
    _bench(d / "c32-defaults-tuned-r1.json", 3150.0, 90.0)
    _bench(d / "c32-defaults-tuned-r2.json", 3120.0, 90.0)
    _bench(d / "c256-recipe-plain-r1.json", 12000.0, 500.0)
    _bench(d / "c256-recipe-tuned-r1.json", 0.0, 0.0, ok=False)  # a failed bench: no reading
    (d / "c256-recipe-tuned-r2.json.part").write_text("")  # cut short: ignored
    md = e2e.table(tmp_path)
    rows = {(r["streams"], r["base"]): r for r in e2e.rows(tmp_path)}
    r = rows[(32, "defaults")]
    assert r["plain"] == [3000.0, 3060.0] and r["tuned"] == [3150.0, 3120.0]
    assert r["ratio"] == pytest.approx((3150 * 3120) ** 0.5 / (3000 * 3060) ** 0.5, rel=1e-3)
    assert r["ci_low"] < r["ratio"] < r["ci_high"] and "df=2" in r["method"]
    # a variant without a reading: listed, no ratio
    assert rows[(256, "recipe")]["ratio"] is None and rows[(256, "recipe")]["tuned"] == []
    assert "| 32 | defaults | 3,000, 3,060 | 3,150, 3,120 |" in md and "not measured" in md
    assert (tmp_path / "e2e.csv").read_text().count("\n") == 3


def test_the_table_also_sets_the_recipe_against_the_defaults(tmp_path: Path) -> None:
    d = tmp_path / "e2e"
    _bench(d / "c32-defaults-plain-r1.json", 1661.0, 45.0)
    _bench(d / "c32-recipe-plain-r1.json", 2117.0, 97.0)
    _bench(d / "c32-defaults-tuned-r1.json", 1689.0, 21.0)
    _bench(d / "c256-defaults-plain-r1.json", 6683.0, 1000.0)  # no recipe at 256: no row
    rr = e2e.recipe_rows(tmp_path)
    assert [(r["streams"], r["variant"]) for r in rr] == [(32, "plain")]
    assert rr[0]["ratio"] == pytest.approx(2117 / 1661, rel=1e-3)
    assert rr[0]["ci_low"] < rr[0]["ratio"] < rr[0]["ci_high"]
    assert "| 32 | default | 1.274 [" in e2e.table(tmp_path)

