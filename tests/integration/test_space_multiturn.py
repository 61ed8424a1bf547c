"""multiturn.yaml's non-default corner served by a real CPU vLLM: the flags start the server
and take effect (its own cache-config gauge reports them)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from autotune.engine import VllmServer
from autotune.space import ModelFacts, load_space
from tests.conftest import needs_vllm

REPO = Path(__file__).resolve().parents[2]

CORNER = {"enable_prefix_caching": False, "block_size": 32, "max_num_seqs": 16,
          "max_num_batched_tokens": 512, "long_prefill_token_threshold": 256}


@needs_vllm
@pytest.mark.slow
def test_multiturn_corner_starts_a_cpu_server(tiny_llama: Path, tmp_path: Path) -> None:
    space = load_space(REPO / "search_spaces" / "multiturn.yaml",
                       facts=ModelFacts.from_model_dir(tiny_llama, device="cpu"))
    assert space.violations(CORNER) == []
    launch = space.launch_spec(CORNER)
    log = tmp_path / "server.log"
    server = VllmServer(model=str(tiny_llama), flags=launch.flags, env=launch.env, log_path=log,
                        start_timeout_s=300)
    server.start()
    try:
        server.wait_healthy()
        with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
    finally:
        errors = server.stop()
    assert errors == []
    info = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert labels["block_size"] == "32" and labels["enable_prefix_caching"] == "False"
    text = log.read_text()
    assert "Chunked prefill is enabled with max_num_batched_tokens=512." in text
    args = next(ln for ln in text.splitlines() if "non-default args:" in ln)
    assert "'long_prefill_token_threshold': 256" in args and "'max_num_seqs': 16" in args
