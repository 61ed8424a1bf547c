"""Helpers shared by tests/integration/test_study_verdict.py and tests/unit/test_study_verdict.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autotune.config import TuneSettings
from autotune.exec import InlineExecutor
from autotune.trial import TrialOutcome, TrialSpec
from tests.conftest import REPO


def study(tmp_path: Path, model: Path, fn: Callable[[TrialSpec], TrialOutcome], **kw: object
          ) -> tuple[object, Path, str]:
    from autotune.study import tune

    tracking = f"sqlite:///{tmp_path}/mlflow.db"
    settings = TuneSettings(
        model=model, shape=REPO / "traffic" / "example-chat.json",
        space=REPO / "search_spaces" / "cpu.yaml",
        tracking_uri=tracking, out=tmp_path / "out", use_ray=False, quality_probe=False,
        enqueue=[{"max_num_seqs": 8}], seed=1,
        **{"trials": 6, "recheck": 1, "recheck_starts": 2, "study_name": "sim",
           "storage": f"sqlite:///{tmp_path}/optuna.db", **kw},  # type: ignore[arg-type]
    )  # fmt: skip
    return tune(settings, executor=InlineExecutor(fn)), tmp_path / "out", tracking


# a warm start of vLLM's defaults at 256 streams on the H200 (experiments/h200-trust/
# results-x1-c256/server-logs.tgz, trial-0003-server.log), the lines start_phases() dates
_H200_WARM = """\
$ /opt/torch/.venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /m
(APIServer pid=3507) INFO 12-01 13:13:46 [api_utils.py:345]
(APIServer pid=3507) INFO 12-01 13:13:47 [vllm.py:1109] Asynchronous scheduling is enabled.
(EngineCore pid=3537) INFO 12-01 13:14:11 [core.py:116] Initializing a V1 LLM engine (v0.26.0)
[W1201 13:14:13.596186275 socket.cpp:207] [c10d] The hostname of the client socket ...
(EngineCore pid=3537) INFO 12-01 13:14:17 [gpu_model_runner.py:5347] Model loading took 58.92 GiB memory and 0.619615 seconds
(EngineCore pid=3537) INFO 12-01 13:14:19 [monitor.py:53] torch.compile took 1.96 s in total
(EngineCore pid=3537) INFO 12-01 13:14:21 [monitor.py:81] Initial profiling/warmup run took 1.63 s
(EngineCore pid=3537) 2026-12-01 13:14:24,460 - INFO - autotuner.py:651 - flashinfer.jit: [Autotuner]: ...
(EngineCore pid=3537) INFO 12-01 13:14:24 [cutedsl_warmup.py:101] Skipping CuTeDSL warmup because ...
(EngineCore pid=3537) INFO 12-01 13:14:36 [gpu_model_runner.py:6844] Graph capturing finished in 12 secs, took 0.80 GiB
"""


# vLLM 0.26 on the H200 (experiments/h200-trust/results-x2-c32/server-logs.tgz): a cold start
# and a warm one of the same flags; the kernel warm-up between the profiling run and the
# CUDA-graph capture is dated by the log's timestamps.
_H200 = """\
(EngineCore pid=3507) INFO 12-01 10:09:35 [monitor.py:53] torch.compile took {tc} s in total
(EngineCore pid=3507) INFO 12-01 {t0} [monitor.py:81] Initial profiling/warmup run took {pr} s
(EngineCore pid=3507) INFO 12-01 {t1} [cutedsl_warmup.py:101] Skipping CuTeDSL warmup because ...
(EngineCore pid=3507) INFO 12-01 {t1} [gpu_model_runner.py:6798] Rank 0: Torch profiler disabled ...
"""
