"""Deployment files of one measured config: Kubernetes Deployment + Service, a compose
file, the ``vllm serve`` command. Pure: they return text; the CLI writes it."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath

from autotune.deploy._source import ExportSource
from autotune.deploy._standin import STAND_IN_NOTE, Deployable

__all__ = ["ExportOptions", "compose_file", "default_image", "k8s_objects", "k8s_yaml",
           "serve_script"]

PORT = 8000
#: vLLM's own images: the OpenAI server for GPUs; the CPU build's release images
_GPU_IMAGE = "vllm/vllm-openai"
_CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo"


def default_image(src: ExportSource) -> str:
    """The vLLM image of the version the study ran (``latest`` where none was recorded)."""
    tag = f"v{src.engine_version}" if src.engine_version else "latest"
    return f"{_CPU_IMAGE if src.device == 'cpu' else _GPU_IMAGE}:{tag}"


@dataclass(frozen=True)
class ExportOptions:
    """What a deployment adds to a config: names, image, where the model is."""

    name: str = "vllm"
    image: str | None = None  # None: default_image()
    namespace: str | None = None
    replicas: int | None = None  # None: the study's GPUs needed / GPUs per server
    model_pvc: str | None = None  # None: the model folder as a hostPath volume
    served_model_name: str | None = None


def _name(text: str) -> str:
    """A DNS-1123 label from ``text`` (Kubernetes object names)."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    return s or "vllm"


def model_mount(src: ExportSource) -> str:
    """Where the model folder is mounted in the container."""
    return str(PurePosixPath("/models") / (PurePosixPath(src.model).name or "model"))


def server_args(src: ExportSource, dep: Deployable, opts: ExportOptions) -> list[str]:
    """``vllm serve`` arguments: the model (as mounted), the address, the config's flags."""
    served = opts.served_model_name or PurePosixPath(src.model).name or "model"
    return [model_mount(src), "--served-model-name", served, "--host", "0.0.0.0",
            "--port", str(PORT), *dep.flags]


def server_env(src: ExportSource, dep: Deployable) -> dict[str, str]:
    """The config's environment, plus what the CPU build's trials were given."""
    env = dict(dep.env)
    if src.device == "cpu" and src.cpu_kv_cache_gib:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{src.cpu_kv_cache_gib:g}")
    return env


def study_annotations(src: ExportSource, dep: Deployable) -> dict[str, str]:
    """The study's verdict and ratio (and a stand-in's warning) as annotations."""
    a = {"autotune.io/study": src.study, "autotune.io/trial": str(src.trial),
         "autotune.io/verdict": src.verdict or "unknown",
         "autotune.io/engine": f"vllm {src.engine_version or '?'} ({src.device})"}
    r = src.ratio_to_defaults
    if r:
        a["autotune.io/ratio-to-defaults"] = (f"{r['median']:.3f} (95 % interval "
                                              f"{r['ci_low']:.3f}-{r['ci_high']:.3f})")
    if src.value is not None:
        a["autotune.io/measured"] = f"{src.value:.6g} {src.metric}"
    if src.shape_fingerprint:
        a["autotune.io/shape"] = f"{src.shape_path or '?'} ({src.shape_fingerprint})"
    if not src.feasible:
        a["autotune.io/feasible"] = "false (exported with --force)"
    if dep.stand_in:
        a["autotune.io/stand-in"] = STAND_IN_NOTE + "; dropped: " + ", ".join(dep.dropped)
    return a


def _probe(path: str, *, period: int, failures: int) -> dict[str, object]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def k8s_objects(src: ExportSource, dep: Deployable, opts: ExportOptions) -> list[dict[str, object]]:
    """A Deployment and a Service for the config (see docs/cost.md, "Deploying")."""
    name = _name(opts.name)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "autotune"}
    meta: dict[str, object] = {"name": name, "labels": labels}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    resources: dict[str, object] = {}
    if src.device != "cpu":
        n = str(src.gpus_per_server)
        resources = {"limits": {"nvidia.com/gpu": n}, "requests": {"nvidia.com/gpu": n}}
    volume: dict[str, object] = ({"name": "model", "persistentVolumeClaim": {
        "claimName": opts.model_pvc, "readOnly": True}} if opts.model_pvc else
        {"name": "model", "hostPath": {"path": src.model, "type": "Directory"}})
    volumes = [volume, {"name": "shm", "emptyDir": {"medium": "Memory"}}]
    container = {
        "name": "vllm", "image": opts.image or default_image(src),
        "command": ["vllm", "serve"], "args": server_args(src, dep, opts),
        "env": [{"name": k, "value": v} for k, v in sorted(server_env(src, dep).items())],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": resources,
        "volumeMounts": [{"name": "model", "mountPath": model_mount(src), "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"}],
        # a start loads weights and compiles: up to 30 min before /health answers
        "startupProbe": _probe("/health", period=10, failures=180),
        "readinessProbe": _probe("/health", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=6),
    }  # fmt: skip
    pod_annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
                       "prometheus.io/path": "/metrics", **study_annotations(src, dep)}
    deployment: dict[str, object] = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {**meta, "annotations": study_annotations(src, dep)},
        "spec": {
            "replicas": opts.replicas if opts.replicas is not None else src.replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {"metadata": {"labels": labels, "annotations": pod_annotations},
                         "spec": {"containers": [container], "volumes": volumes}},
        },
    }  # fmt: skip
    service: dict[str, object] = {
        "apiVersion": "v1", "kind": "Service", "metadata": {**meta},
        "spec": {"selector": {"app.kubernetes.io/name": name},
                 "ports": [{"name": "http", "port": PORT, "targetPort": "http",
                            "protocol": "TCP"}]},
    }  # fmt: skip
    return [deployment, service]


def _header(src: ExportSource, dep: Deployable, fmt: str) -> str:
    lines = [f"autotune export --format {fmt}: study {src.study}, trial {src.trial}, "
             f"verdict {src.verdict or 'unknown'}"]
    if dep.stand_in:
        lines.append("NOTE: " + STAND_IN_NOTE)
        lines.append("dropped: " + ", ".join(dep.dropped))
    if not src.feasible:
        lines.append("WARNING: the study never measured this config feasible (--force)")
    return "".join(f"# {line}\n" for line in lines)


def _dump_all(docs: list[dict[str, object]]) -> str:
    """YAML documents without anchors and aliases (a shared dict is written out each time)."""
    import yaml

    class _Plain(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=_Plain, sort_keys=False)


def k8s_yaml(src: ExportSource, dep: Deployable, opts: ExportOptions) -> str:
    """The Deployment and the Service as one multi-document YAML file."""
    docs = _dump_all(k8s_objects(src, dep, opts))
    return _header(src, dep, "k8s") + docs


def compose_file(src: ExportSource, dep: Deployable, opts: ExportOptions) -> str:
    """A compose file with one service running the config."""
    svc: dict[str, object] = {
        "image": opts.image or default_image(src), "entrypoint": ["vllm", "serve"],
        "command": server_args(src, dep, opts), "environment": server_env(src, dep),
        "ports": [f"{PORT}:{PORT}"], "ipc": "host",
        "volumes": [f"{src.model}:{model_mount(src)}:ro"],
        "labels": study_annotations(src, dep),
        "healthcheck": {"test": ["CMD", "python3", "-c", "import urllib.request; urllib."
                                 f"request.urlopen('http://localhost:{PORT}/health')"],
                        "interval": "10s", "timeout": "5s", "retries": 3,
                        "start_period": "30m"},
    }  # fmt: skip
    if src.device != "cpu":
        svc["deploy"] = {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "count": src.gpus_per_server, "capabilities": ["gpu"]}]}}}
    return _header(src, dep, "compose") + _dump_all([{"services": {_name(opts.name): svc}}])


def serve_script(src: ExportSource, dep: Deployable) -> str:
    """The ``vllm serve`` command (a shell script), as ``serve_command.sh`` has it."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(server_env(src, dep).items()))
    cmd = shlex.join(["vllm", "serve", src.model, *dep.flags])
    line = f"{prefix} {cmd}" if prefix else cmd
    return "#!/bin/sh\n" + _header(src, dep, "serve") + line + "\n"
