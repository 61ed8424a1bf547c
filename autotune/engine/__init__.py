"""Inference engines: start a server with a config, wait for it, watch it, stop it.

:class:`VllmServer` starts, watches and stops one vLLM server; :func:`detect_engine` says
which vLLM build is installed. The failure classes of a server are
:class:`~autotune.schema.FailureReason` values.
"""

from __future__ import annotations

from autotune.engine._launcher import preload_scope
from autotune.engine._vllm import (
    EngineInfo,
    FailureReason,
    VllmServer,
    cache_env,
    classify_failure,
    classifying_lines,
    detect_engine,
    free_port,
    serve_command,
    translate_flags,
)

__all__ = [
    "EngineInfo",
    "FailureReason",
    "VllmServer",
    "cache_env",
    "classify_failure",
    "classifying_lines",
    "detect_engine",
    "free_port",
    "preload_scope",
    "serve_command",
    "translate_flags",
]

