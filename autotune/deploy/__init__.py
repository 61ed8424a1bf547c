"""From a measured config to a deployment: what only a stand-in needs dropped, whether the
config can serve a traffic shape, and the files that run it (Kubernetes, compose, ``vllm
serve``). ``autotune export`` is the command (autotune/cli/_export.py; docs/cost.md)."""

from autotune.deploy._export import Exported, ExportError, deploy_config, export
from autotune.deploy._fit import Fit, check_fit, context_of
from autotune.deploy._render import (
    ExportOptions,
    compose_file,
    default_image,
    k8s_objects,
    k8s_yaml,
    serve_script,
)
from autotune.deploy._source import ExportSource, from_best_json, from_study
from autotune.deploy._standin import STAND_IN_NOTE, Deployable, deployable

__all__ = [
    "STAND_IN_NOTE",
    "Deployable",
    "ExportError",
    "ExportOptions",
    "ExportSource",
    "Exported",
    "Fit",
    "check_fit",
    "compose_file",
    "context_of",
    "default_image",
    "deploy_config",
    "deployable",
    "export",
    "from_best_json",
    "from_study",
    "k8s_objects",
    "k8s_yaml",
    "serve_script",
]
