"""vLLM's router (``vllm-router``) driven through its admin API.

``GET /list_workers`` names the workers it routes to, ``POST /add_worker?url=URL`` adds one
(the router checks its ``/health`` first and refuses a worker that does not answer),
``POST /remove_worker?url=URL`` takes one out: requests already sent to it finish there,
new ones go to the others. Every failure is a :class:`RouterError` that names the router,
what it answered and the fix.
"""

from __future__ import annotations

import json
import logging
from urllib.parse import quote

from autotune.errors import RolloutError
from autotune.load import _http

__all__ = ["RouterClient", "RouterError"]

logger = logging.getLogger(__name__)


class RouterError(RolloutError):
    """The router cannot be reached, or refused an admin call."""


def _norm(url: str) -> str:
    return url.rstrip("/")


class RouterClient:
    """The admin API of one ``vllm-router`` at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, *, timeout_s: float = 30.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise RouterError(f"router URL {base_url!r} must start with http:// or https://")
        self.base_url = _norm(base_url)
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str) -> _http.Response:
        url = self.base_url + path
        try:
            if method == "GET":
                return _http.get(url, timeout_s=self.timeout_s)
            return _http.post(url, timeout_s=self.timeout_s)
        except _http.HttpError as exc:
            raise RouterError(
                f"the router at {self.base_url} cannot be reached ({method} {path}: {exc}); "
                "start it (vllm-router --worker-urls ...) or fix --router"
            ) from exc

    def list_workers(self) -> list[str]:
        """The worker URLs the router routes to now."""
        resp = self._call("GET", "/list_workers")
        if resp.status != 200:
            raise RouterError(f"the router at {self.base_url} answered HTTP {resp.status} to "
                              "GET /list_workers; is it a vllm-router?")
        try:
            body = json.loads(resp.text)
            urls = body["urls"] if isinstance(body, dict) else body
            return [_norm(str(u)) for u in urls]
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterError(f"the router at {self.base_url} answered GET /list_workers with "
                              f"{resp.text[:200]!r}, not a list of workers; is it a "
                              "vllm-router?") from exc

    def add_worker(self, url: str) -> None:
        """Add ``url``; raises :class:`RouterError` when the router refuses it. The router
        answers once the worker's ``/health`` does (it waits up to its
        ``--worker-startup-timeout-secs``): a worker that does not answer in ``timeout_s``
        is an error too."""
        try:
            resp = _http.post(self.base_url + f"/add_worker?url={quote(_norm(url), safe='')}",
                              timeout_s=self.timeout_s)
        except _http.HttpError as exc:
            raise RouterError(
                f"the router at {self.base_url} did not accept worker {url} within "
                f"{self.timeout_s:g} s ({exc}); check that {url}/health answers from the "
                "router's host"
            ) from exc
        if resp.status != 200:
            raise RouterError(
                f"the router at {self.base_url} refused worker {url} (HTTP {resp.status}: "
                f"{resp.text.strip()[:200]}); check that {url}/health answers from the "
                "router's host"
            )
        logger.info("router %s: added %s", self.base_url, url)

    def remove_worker(self, url: str) -> None:
        """Take ``url`` out of the router (requests it holds finish there)."""
        resp = self._call("POST", f"/remove_worker?url={quote(_norm(url), safe='')}")
        if resp.status != 200:
            raise RouterError(
                f"the router at {self.base_url} did not remove worker {url} (HTTP "
                f"{resp.status}: {resp.text.strip()[:200]}); remove it by hand"
            )
        logger.info("router %s: removed %s", self.base_url, url)
