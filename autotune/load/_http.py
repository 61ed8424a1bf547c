"""The one HTTP client of autotune's non-hot paths: ``/health``, ``/metrics``, the quality
probe's completions, the MLflow server's health, the router's admin API.

Blocking calls over the standard library (``urllib``): each is one small request, and an
asyncio caller runs them in a thread (:func:`aget`) so its loop never waits. The load
generator's streams are the hot path and have their own wire (:mod:`autotune.load`).
Any failure to get an answer raises :class:`HttpError` (an :class:`OSError`), which callers
turn into their own error with the context; an answer with any status is returned.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

__all__ = ["HttpError", "Response", "aget", "get", "post", "post_json"]


class HttpError(OSError):
    """No answer: the connection failed, timed out, or the URL is not usable."""


@dataclass(frozen=True)
class Response:
    status: int
    text: str
    taken_at: float  # time.time() when the answer's headers arrived


def _send(req: urllib.request.Request, timeout_s: float) -> Response:
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            taken_at = time.time()
            return Response(int(r.status), r.read().decode("utf-8", "replace"), taken_at)
    except urllib.error.HTTPError as exc:  # an answer, with a status that is not 2xx
        with exc:
            body = exc.read().decode("utf-8", "replace") if exc.fp is not None else ""
        return Response(int(exc.code), body, time.time())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise HttpError(f"{type(reason).__name__}: {reason}") from exc


def get(url: str, *, timeout_s: float = 10.0) -> Response:
    """GET ``url``."""
    return _send(urllib.request.Request(url, method="GET"), timeout_s)


def post(url: str, data: bytes = b"", *, timeout_s: float = 60.0) -> Response:
    """POST ``data`` (an admin call's empty body by default) to ``url``."""
    return _send(urllib.request.Request(url, data=data, method="POST"), timeout_s)


def post_json(url: str, payload: object, *, timeout_s: float = 60.0) -> Response:
    """POST ``payload`` as JSON to ``url``."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    return _send(req, timeout_s)


async def aget(url: str, *, timeout_s: float = 10.0) -> Response:
    """:func:`get` from a coroutine (in a thread: the caller's loop keeps running)."""
    return await asyncio.to_thread(get, url, timeout_s=timeout_s)
