"""Ray places each trial on as many GPUs of one node as its config needs, never one GPU
for two trials: a real local Ray offering four fake GPUs (Ray's ``num_gpus`` resources),
the real study loop, and trials that report the GPU ids Ray gave them (no server)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.config import TuneSettings
from autotune.store import A
from autotune.trial import TrialOutcome, TrialSpec
from tests.conftest import REPO
from tests.integration.test_study_gpus import gpu_model

# (tensor, data parallel size, max-num-seqs): 1-, 2-, 4- and 1-GPU trials
CONFIGS = [(1, 1, 64), (2, 1, 128), (1, 1, 256), (4, 1, 512), (1, 2, 1024)]


def _trial(spec: TrialSpec) -> TrialOutcome:
    """In the Ray worker: hold the GPUs Ray assigned for a while, say which they were."""
    import time

    import ray

    from autotune.parallelism import server_gpus

    ids = tuple(int(i) for i in ray.get_gpu_ids())
    t0 = time.time()
    time.sleep(3.0 if server_gpus(spec.flags) == 2 else 1.5)
    t1 = time.time()
    tput = 1000.0 * server_gpus(spec.flags)
    return TrialOutcome(number=spec.number, ok=True, gpus=ids, wall_s=t1 - t0, start_s=0.1,
                        metrics={"output_tokens_per_s": tput, "error_rate": 0.0,
                                 "ttft_p99_s": 0.1, "t0": t0, "t1": t1})


@pytest.mark.slow  # a local Ray start: about 10-30 s
def test_ray_gives_each_trial_its_gpus_of_one_node_and_never_shares_one(tmp_path: Path) -> None:
    from autotune.exec import RayExecutor
    from autotune.study import tune

    model = gpu_model(tmp_path)
    enqueue = [{"tensor_parallel_size": tp, "data_parallel_size": dp, "max_num_seqs": s}
               for tp, dp, s in [CONFIGS[0], (8, 1, 64), *CONFIGS[1:]]]
    settings = TuneSettings(
        model=model, shape=REPO / "traffic" / "example-chat.json",
        space=REPO / "search_spaces" / "dense.yaml", trials=len(CONFIGS), recheck=0,
        baseline=False, sampler="random", enqueue=enqueue, pruner="none",
        storage=f"sqlite:///{tmp_path}/optuna.db", study_name="ray-gpus", out=tmp_path / "out",
        quality_probe=False, gpus_per_trial=1)
    ex = RayExecutor(num_gpus=4, gpus_per_trial=1, fn=_trial)
    try:
        assert ex.gpu_node() is not None and ex.gpu_node().gpus == 4  # type: ignore[union-attr]
        tune(settings, executor=ex, tracker=False)
    finally:
        ex.shutdown()
    study = optuna.load_study(study_name="ray-gpus", storage=f"sqlite:///{tmp_path}/optuna.db")
    ran: list[dict[str, Any]] = []
    for t in study.get_trials():
        if t.user_attrs.get(A.REASON) == "rejected":  # TP 8 on a node of 4, never started
            assert "8 GPUs for one server, but a node has 4" in t.user_attrs[A.MESSAGE]
            continue
        assert A.METRICS in t.user_attrs, (t.user_attrs.get(A.REASON),
                                           t.user_attrs.get(A.MESSAGE))
        m = t.user_attrs[A.METRICS]
        ran.append({"n": t.user_attrs[A.SERVER_GPUS], "gpus": t.user_attrs[A.GPUS],
                    "t0": m["t0"], "t1": m["t1"]})
    assert sorted(r["n"] for r in ran) == [1, 1, 2, 2, 4]
    for r in ran:  # each trial got exactly its server's GPUs, all distinct
        assert len(set(r["gpus"])) == r["n"] and set(r["gpus"]) <= {0, 1, 2, 3}, r
    for a in ran:  # trials that overlapped in time had no GPU in common
        for b in ran:
            if a is not b and a["t0"] < b["t1"] and b["t0"] < a["t1"]:
                assert not set(a["gpus"]) & set(b["gpus"]), (a, b)
    assert any(a is not b and a["t0"] < b["t1"] and b["t0"] < a["t1"]
               for a in ran for b in ran)  # some ran side by side: packed, not one by one
