"""Inference engines: start a server with a config, wait for it, watch it, stop it.

:class:`Engine` is the plug-in point (a Protocol); :class:`VllmServer` is the vLLM
implementation. A trial only needs ``start``, ``wait_healthy``, ``check_alive``, ``stop``,
``base_url``, ``served_model_name`` and ``log_tail``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from autotune.engine._vllm import (
    EngineInfo,
    FailureReason,
    VllmServer,
    classify_failure,
    classifying_lines,
    detect_engine,
    free_port,
    serve_command,
    translate_flags,
)

__all__ = [
    "Engine",
    "EngineInfo",
    "FailureReason",
    "VllmServer",
    "classify_failure",
    "classifying_lines",
    "detect_engine",
    "free_port",
    "serve_command",
    "translate_flags",
]


@runtime_checkable
class Engine(Protocol):
    """A serving engine process.

    Contract: ``start()`` returns at once; ``wait_healthy()`` blocks until the OpenAI API
    answers and returns the start time in seconds, or raises ``EngineStartError`` (with a
    ``reason``) after stopping the process; ``check_alive()`` raises ``EngineCrashedError``
    if it died; ``stop()`` never raises, stops every process the engine started and returns
    the errors it met.
    """

    served_model_name: str

    @property
    def base_url(self) -> str: ...

    def start(self) -> None: ...

    def wait_healthy(self, timeout_s: float | None = None) -> float: ...

    def check_alive(self) -> None: ...

    def stop(self, grace_s: float = 20.0) -> list[str]: ...

    def log_tail(self, max_chars: int = 4000) -> str: ...
