"""``--start``: the new server started from a study's best.json, as its trials started it.

The flags and environment are best.json's (``flags``, ``env``); the model is best.json's
unless given; the served model name is the old servers' (from their ``/v1/models``) so the
router's requests are valid on both.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from autotune.errors import ConfigError, EngineError, RolloutError
from autotune.load import _http
from autotune.records import BestFile
from autotune.rollout._run import ManagedServer

__all__ = ["load_best", "served_model_name", "start_new_server"]

logger = logging.getLogger(__name__)


def load_best(path: Path) -> BestFile:
    """best.json; :class:`ConfigError` when it is missing or is not a study's best.json."""
    try:
        return BestFile.load(path)
    except ConfigError as exc:
        raise ConfigError(f"--best {path}: {exc}") from None


def served_model_name(url: str) -> str:
    """The model name ``url`` serves (its ``/v1/models``' first id)."""
    try:
        resp = _http.get(url + "/v1/models", timeout_s=10.0)
        return str(json.loads(resp.text)["data"][0]["id"])
    except (_http.HttpError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RolloutError(f"cannot read the served model name from {url}/v1/models ({exc}); "
                           "give --served-model-name") from exc


def start_new_server(*, best: BestFile, model: str | None, served_name: str,
                     log_path: Path, extra_flags: Sequence[str] = (), port: int | None = None,
                     gpus: Sequence[int] | None = None,
                     start_timeout_s: float = 900.0) -> ManagedServer:
    """Start best.json's config and wait until it answers; raises :class:`RolloutError`
    when it does not start (nothing in the router changed yet)."""
    from autotune.engine import VllmServer

    model = model or best.model
    if not model:
        raise ConfigError("best.json names no model; give --model")
    server = VllmServer(model=model, flags=[*best.flags, *extra_flags], env=dict(best.env),
                        log_path=log_path, port=port, served_model_name=served_name,
                        gpus=gpus, start_timeout_s=start_timeout_s)
    logger.info("starting the new server: %s %s", model, " ".join(server.flags))
    try:
        server.start()
        server.wait_healthy()
    except EngineError as exc:
        server.stop()
        raise RolloutError(f"the new server did not start: {str(exc).splitlines()[0]} "
                           f"(log: {log_path}); nothing was changed in the router") from exc
    return ManagedServer(url=server.base_url, stop=server.stop, poll=server.poll)
