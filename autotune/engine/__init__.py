"""Inference engines: start a server with a config, wait for it, watch it, stop it.

:class:`VllmServer` starts, watches and stops one vLLM server; :func:`detect_engine` says
which vLLM build is installed. The failure classes of a server are
:class:`~autotune.store.FailureReason` values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune import lazy_exports

if TYPE_CHECKING:
    from autotune.engine._failure import classify_failure, classifying_lines
    from autotune.engine._launcher import preload_scope
    from autotune.engine._log import _compile_in as _compile_in
    from autotune.engine._log import _log_bytes as _log_bytes
    from autotune.engine._log import _phases_in as _phases_in
    from autotune.engine._log import compile_seconds, start_phases
    from autotune.engine._modelgen import (
        generate_tiny_model,
        tiny_config,
        write_bpe_tokenizer,
        write_tokenizer,
    )
    from autotune.engine._vllm import (
        EngineInfo,
        FailureReason,
        VllmServer,
        cache_env,
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
    "compile_seconds",
    "detect_engine",
    "free_port",
    "generate_tiny_model",
    "preload_scope",
    "serve_command",
    "start_phases",
    "tiny_config",
    "translate_flags",
    "write_bpe_tokenizer",
    "write_tokenizer",
]

# Each name is imported from its module on first use: importing the package (or one
# of its modules) loads nothing else.
__getattr__ = lazy_exports(__name__, {
    "autotune.engine._failure": ("classify_failure", "classifying_lines"),
    "autotune.engine._launcher": ("preload_scope",),
    "autotune.engine._log": (
        "_compile_in",
        "_log_bytes",
        "_phases_in",
        "compile_seconds",
        "start_phases",
    ),
    "autotune.engine._modelgen": (
        "generate_tiny_model",
        "tiny_config",
        "write_bpe_tokenizer",
        "write_tokenizer",
    ),
    "autotune.engine._vllm": (
        "EngineInfo",
        "FailureReason",
        "VllmServer",
        "cache_env",
        "detect_engine",
        "free_port",
        "serve_command",
        "translate_flags",
    ),
})
