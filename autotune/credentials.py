"""Passwords in store URLs: never written, never logged.

A PostgreSQL ``--storage`` or an MLflow ``--tracking-uri`` may carry a password
(``postgresql://user:secret@host/db``). autotune uses it to connect, but every record it
writes (``config.yaml``, ``study.json``, ``best.json``, the study's Optuna attributes,
MLflow params, log lines and error messages) carries :func:`redact`'s form instead. The
ways that keep the password out of the command line too are the drivers' own:
``PGPASSWORD`` or a pass file (``~/.pgpass``, ``PGPASSFILE``) for PostgreSQL, and
``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` for an MLflow server.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["URL_FIELDS", "has_password", "redact", "redact_settings", "warn_if_password"]

logger = logging.getLogger(__name__)

#: ``user:password@`` right after ``scheme://`` (the password may hold any character but
#: ``@`` and ``/``, as URL syntax requires once it is percent-encoded)
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*):(?P<pw>[^@/]*)@")
#: the settings that are URLs of stores
URL_FIELDS = ("storage", "tracking_uri")
_warned: set[str] = set()


def has_password(url: str | None) -> bool:
    """Whether ``url`` carries a password (``scheme://user:password@...``)."""
    m = _USERINFO.search(url or "")
    return bool(m and m.group("pw"))


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``."""
    return _USERINFO.sub(lambda m: f"{m.group('head')}:***@" if m.group("pw") else m.group(0),
                         text)


_V = TypeVar("_V")


def redact_settings(record: Mapping[str, _V]) -> dict[str, _V | str]:
    """A settings record (``TuneSettings.model_dump(mode="json")``) with its store URLs
    redacted: what ``config.yaml``, ``study.json`` and the study's attributes hold."""
    out: dict[str, _V | str] = dict(record)
    for key in URL_FIELDS:
        value = out.get(key)
        if isinstance(value, str):
            out[key] = redact(value)
    return out


def warn_if_password(option: str, url: str | None, *, env: str) -> None:
    """Log once per URL that ``option`` carries a password that is not written anywhere,
    and where it belongs instead."""
    if not url or not has_password(url) or url in _warned:
        return
    _warned.add(url)
    logger.warning("%s %s carries a password: it is used, but written nowhere (files, "
                   "MLflow, logs); %s keeps it off the command line too", option,
                   redact(url), env)
