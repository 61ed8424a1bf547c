"""Trials of different GPU counts in one study: the real loop, Optuna (SQLite) and result
files with the simulated executor on a node of four GPUs (no server, a simulated clock):
placement with no GPU shared and none idle while a trial that fits waits, rejection of a
config over the node's GPUs before it starts, and the per-GPU objective."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.config import TuneSettings
from autotune.events import StudyCallback
from autotune.parallelism import server_gpus
from autotune.store import A, FailureReason
from autotune.study import tune
from autotune.testing import SimulatedExecutor, TimelineEntry
from autotune.trial import TrialSpec
from tests.conftest import REPO

# (tensor, data parallel size, max-num-seqs) of each enqueued config, in the order they are
# asked, and its simulated wall time: 1-, 2- and 4-GPU trials, and one over the node
CONFIGS = [((1, 1, 64), 10.0), ((8, 1, 64), 10.0), ((2, 1, 128), 30.0), ((1, 1, 256), 20.0),
           ((4, 1, 512), 10.0), ((1, 2, 1024), 10.0), ((1, 1, 1024), 10.0)]
WALL = dict(CONFIGS)


def gpu_model(tmp_path: Path) -> Path:
    """A model folder whose config.json lets TP 1-8 divide its heads (no weights)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 512,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    return d


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return gpu_model(tmp_path)


def _sizes(params: dict[str, Any]) -> tuple[int, int]:
    return int(params.get("tensor_parallel_size", 1)), int(params.get("data_parallel_size", 1))


def _duration(params: dict[str, Any], spec: TrialSpec) -> float:
    return WALL[(*_sizes(params), int(params["max_num_seqs"]))]


def _measure(params: dict[str, Any], spec: TrialSpec) -> dict[str, float]:
    """A server on n GPUs serves 1.8x a 1-GPU one's tokens/s on 2, 3x on 4: less per GPU."""
    n = server_gpus(spec.flags)
    tput = 1000.0 * {1: 1.0, 2: 1.8, 4: 3.0}[n]
    return {"output_tokens_per_s": tput, "output_tokens_per_s_ci_low": tput * 0.98,
            "output_tokens_per_s_ci_high": tput * 1.02, "ttft_p99_s": 0.5, "error_rate": 0.0,
            "goodput_rps": tput / 100}


class Waits(StudyCallback):
    """When (on the simulated clock) each trial began to wait for its GPUs."""

    def __init__(self, sim: SimulatedExecutor) -> None:
        self.sim = sim
        self.since: dict[int, float] = {}

    def on_trial_phase(self, number: int, phase: str, elapsed_s: float, detail: str) -> None:
        if phase == "waiting":
            self.since[number] = self.sim.clock


def _settings(model: Path, tmp_path: Path, **kw: Any) -> TuneSettings:
    enqueue = [{"tensor_parallel_size": tp, "data_parallel_size": dp, "max_num_seqs": seqs}
               for (tp, dp, seqs), _ in CONFIGS]
    base: dict[str, Any] = {
        "model": model, "shape": REPO / "traffic" / "example-chat.json",
        "space": REPO / "search_spaces" / "dense.yaml", "trials": 6, "seed": 1, "recheck": 0,
        "baseline": False, "sampler": "random", "enqueue": enqueue, "pruner": "none",
        "storage": f"sqlite:///{tmp_path}/optuna.db", "study_name": "gpus",
        "out": tmp_path / "out", "quality_probe": False, "use_ray": False}
    base.update(kw)
    return TuneSettings(**base)


def _free_at(timeline: list[TimelineEntry], t: float, gpus: int) -> int:
    return gpus - sum(len(e.gpus) for e in timeline if e.start <= t < e.end)


def test_trials_of_1_2_and_4_gpus_are_packed_and_compared_per_gpu(model: Path,
                                                                  tmp_path: Path) -> None:
    sim = SimulatedExecutor(_measure, gpus=4, duration=_duration)
    waits = Waits(sim)
    result = tune(_settings(model, tmp_path), executor=sim, tracker=False,
                  callbacks=[sim, waits])
    study = optuna.load_study(study_name="gpus", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = {t.number: t for t in study.get_trials()}
    line = sorted(sim.timeline, key=lambda e: e.number)
    ran = [(_sizes(trials[e.number].params), e.start, e.end, len(e.gpus)) for e in line]
    # 1, 2 and 1 GPU start at once (the node full); the 4-GPU trial waits for all four
    # (nothing more is asked meanwhile, so small trials cannot starve it), then the rest
    assert ran == [((1, 1), 0, 10, 1), ((2, 1), 0, 30, 2), ((1, 1), 0, 20, 1),
                   ((4, 1), 30, 40, 4), ((1, 2), 40, 50, 2), ((1, 1), 40, 50, 1)]
    # never two trials on one GPU
    for a in line:
        for b in line:
            if a is not b and a.start < b.end and b.start < a.end:
                assert not set(a.gpus) & set(b.gpus), (a, b)
    # no GPU idles while a trial that fits waits: at every moment a trial waited, fewer
    # GPUs were free than it needed
    for number, since in waits.since.items():
        start = next(e.start for e in line if e.number == number)
        need = len(next(e.gpus for e in line if e.number == number))
        moments = {since} | {e.end for e in line if since <= e.end < start}
        assert all(_free_at(line, t, 4) < need for t in moments), (number, since, start)
    assert set(waits.since) == {next(e.number for e in line if len(e.gpus) == 4)}
    # the config over the node's GPUs: rejected before it started, with the count
    (over,) = [t for t in trials.values() if _sizes(t.params) == (8, 1)]
    assert over.user_attrs[A.REASON] == FailureReason.REJECTED
    assert ("TP 8 x DP 1 = 8 GPUs for one server, but a node has 4"
            in over.user_attrs[A.MESSAGE])
    assert over.number not in {e.number for e in line}
    # the GPU-time account counts GPU-seconds: the 4-GPU trial four times its wall time
    acct = study.user_attrs[A.GPU_TIME]
    busy = sum(v for a in acct.values() for k, v in a.items() if k not in ("idle_s", "compile_s"))
    assert busy == pytest.approx(sum(len(e.gpus) * (e.end - e.start) for e in line))
    assert sorted(acct) == ["gpu0", "gpu1", "gpu2", "gpu3"]
    # per GPU: the 2-GPU server's 1.8x and the 4-GPU one's 3x rank below one GPU
    value = {_sizes(t.params): t.values[0] for t in trials.values() if t.values}
    assert value[(1, 1)] == pytest.approx(1000) and value[(2, 1)] == pytest.approx(900)
    assert value[(1, 2)] == pytest.approx(900) and value[(4, 1)] == pytest.approx(750)
    assert result.best is not None
    best = result.best.to_json()
    assert best is not None and _sizes(best["params"]) == (1, 1)
    assert best["objective"]["per_gpu"] and best["objective"]["value"] == pytest.approx(1000)
    g = best["gpus"]
    assert g["per_server"] == 1 and result.verdict["candidate_gpus"] == 1
    # the recorded 5.53 req/s x the mean output length / 1000 out tok/s per server
    assert g["servers_needed"] > 0 and g["gpus_needed"] == pytest.approx(g["servers_needed"])
    two = next(t for t in trials.values() if _sizes(t.params) == (2, 1))
    assert two.user_attrs[A.SERVER_GPUS] == 2
    assert two.user_attrs[A.METRICS]["output_tokens_per_s_per_gpu"] == pytest.approx(900)
    assert "--tensor-parallel-size" in two.user_attrs[A.FLAGS]


def test_a_2_gpu_server_that_more_than_doubles_wins_and_says_its_gpus(model: Path,
                                                                     tmp_path: Path) -> None:
    """Superlinear scaling (2.2x on two GPUs, e.g. a KV cache that only fits there): the
    2-GPU config wins per GPU; best.json, the verdict and the best line say it uses two
    GPUs, and the recorded traffic's needs are counted in GPUs of such servers."""
    from autotune.cli._tune import _best_line, _verdict_line

    def measure(params: dict[str, Any], spec: TrialSpec) -> dict[str, float]:
        noise = 1.0 + 0.01 * (spec.number % 3)  # starts differ a little
        tput = 1000.0 * (2.2 if server_gpus(spec.flags) == 2 else 1.0) * noise
        return {"output_tokens_per_s": tput, "output_tokens_per_s_ci_low": tput * 0.99,
                "output_tokens_per_s_ci_high": tput * 1.01, "ttft_p99_s": 0.5,
                "error_rate": 0.0}

    sim = SimulatedExecutor(measure, gpus=2)
    enqueue = [{"tensor_parallel_size": 2, "max_num_seqs": 128}]
    result = tune(_settings(model, tmp_path, trials=2, baseline=True, enqueue=enqueue,
                            recheck=1, recheck_starts=2),
                  executor=sim, tracker=False, callbacks=[sim])
    assert result.best is not None
    best = result.best.to_json()
    assert best is not None and best["params"]["tensor_parallel_size"] == 2
    assert best["objective"]["value"] == pytest.approx(1100, rel=0.03)
    assert best["objective"]["value_per_server"] == pytest.approx(
        2 * best["objective"]["value"])
    assert best["baseline"]["value"] == pytest.approx(1000, rel=0.03)
    g = best["gpus"]
    assert g["per_server"] == 2 and g["gpus_needed"] == pytest.approx(2 * g["servers_needed"])
    assert result.verdict["candidate_gpus"] == 2
    assert result.verdict["verdict"] == "winner", result.verdict
    assert "(2 GPUs per server)" in _verdict_line(result.verdict)
    assert "per GPU (a server of 2 GPUs; the recorded traffic needs" in _best_line(
        result.best, "throughput")
