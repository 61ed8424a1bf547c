"""A small client of Prometheus' HTTP query API (and of anything that speaks it).

Three endpoints: ``/api/v1/query`` (an instant vector at one time), ``/api/v1/query_range``
(a matrix at steps; ranges longer than Prometheus' 11,000 points per series are split into
several requests) and ``/api/v1/series`` (which series exist in a range: an index lookup, no
samples read). The base URL may carry a path (``https://host/prometheus``, a Grafana data
source proxy, Thanos, Mimir, VictoriaMetrics): the API paths are appended to it.

Credentials never come from the command line: a bearer token or a basic-auth user and
password from the environment (:data:`AUTH_ENV`) or from files named there or by the
caller; a URL with ``user:password@`` in it is refused.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from autotune.errors import ConfigError, TrafficError

__all__ = [
    "AUTH_ENV",
    "MAX_POINTS",
    "PrometheusAuth",
    "PrometheusClient",
    "PrometheusError",
    "PrometheusUnreachableError",
    "Series",
    "auth_from_env",
]

logger = logging.getLogger(__name__)

#: the environment variables read for credentials (a ``*_FILE`` variable names a file whose
#: first line is the secret)
AUTH_ENV: Final = (
    "AUTOTUNE_PROMETHEUS_BEARER_TOKEN",
    "AUTOTUNE_PROMETHEUS_BEARER_TOKEN_FILE",
    "AUTOTUNE_PROMETHEUS_USERNAME",
    "AUTOTUNE_PROMETHEUS_PASSWORD",
    "AUTOTUNE_PROMETHEUS_PASSWORD_FILE",
)
#: points per series in one query_range answer; Prometheus refuses more than 11,000
MAX_POINTS: Final = 10_000


class PrometheusError(TrafficError):
    """Prometheus answered, but with an error (bad query, refused credentials, ...)."""


class PrometheusUnreachableError(PrometheusError):
    """Prometheus did not answer (refused, timed out, DNS, HTTP 5xx)."""


@dataclass(frozen=True)
class PrometheusAuth:
    """Credentials for the ``Authorization`` header: a bearer token, or basic auth."""

    bearer_token: str | None = None
    username: str | None = None
    password: str | None = None

    def header(self) -> str | None:
        if self.bearer_token:
            return f"Bearer {self.bearer_token}"
        if self.username is not None:
            pair = f"{self.username}:{self.password or ''}".encode()
            return "Basic " + base64.b64encode(pair).decode("ascii")
        return None

    def __repr__(self) -> str:  # never print a secret
        kind = "bearer" if self.bearer_token else ("basic" if self.username else "none")
        return f"PrometheusAuth({kind})"


def _read_secret(path: str | Path, what: str) -> str:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{what} {p}: cannot read it ({exc.strerror or exc}); give a "
                          "readable file holding the secret on its first line") from exc
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not line:
        raise ConfigError(f"{what} {p} is empty; put the secret on its first line")
    return line


def auth_from_env(
    env: Mapping[str, str] | None = None,
    *,
    bearer_token_file: str | Path | None = None,
    basic_auth_file: str | Path | None = None,
) -> PrometheusAuth | None:
    """Credentials from files given by the caller, else from the environment (see
    :data:`AUTH_ENV`). ``basic_auth_file`` holds ``user:password`` on its first line.
    None when there are none."""
    env = os.environ if env is None else env
    if bearer_token_file is not None and basic_auth_file is not None:
        raise ConfigError("give a bearer token file or a basic-auth file, not both")
    if bearer_token_file is not None:
        return PrometheusAuth(bearer_token=_read_secret(bearer_token_file, "bearer token file"))
    if basic_auth_file is not None:
        pair = _read_secret(basic_auth_file, "basic-auth file")
        if ":" not in pair:
            raise ConfigError(f"basic-auth file {basic_auth_file}: its first line must be "
                              "'user:password'")
        user, _, password = pair.partition(":")
        return PrometheusAuth(username=user, password=password)
    token = env.get("AUTOTUNE_PROMETHEUS_BEARER_TOKEN") or None
    if token is None and env.get("AUTOTUNE_PROMETHEUS_BEARER_TOKEN_FILE"):
        token = _read_secret(env["AUTOTUNE_PROMETHEUS_BEARER_TOKEN_FILE"],
                             "AUTOTUNE_PROMETHEUS_BEARER_TOKEN_FILE")
    login = env.get("AUTOTUNE_PROMETHEUS_USERNAME") or None
    if token is not None and login is not None:
        raise ConfigError("both a bearer token and a username are set in the environment "
                          "(AUTOTUNE_PROMETHEUS_*): unset one of them")
    if token is not None:
        return PrometheusAuth(bearer_token=token)
    if login is None:
        return None
    secret = env.get("AUTOTUNE_PROMETHEUS_PASSWORD")
    if secret is None and env.get("AUTOTUNE_PROMETHEUS_PASSWORD_FILE"):
        secret = _read_secret(env["AUTOTUNE_PROMETHEUS_PASSWORD_FILE"],
                              "AUTOTUNE_PROMETHEUS_PASSWORD_FILE")
    return PrometheusAuth(username=login, password=secret)


@dataclass(frozen=True)
class Series:
    """One series of an answer: its labels and its (unix time, value) points."""

    labels: Mapping[str, str]
    points: Sequence[tuple[float, float]]

    @property
    def value(self) -> float:
        """The value of an instant vector's element (its one point)."""
        return self.points[-1][1] if self.points else math.nan


def _check_base(url: str) -> str:
    u = url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"Prometheus URL {url!r} must be http(s)://HOST[:PORT][/PATH]")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            "the Prometheus URL carries credentials (user:password@): they would show in the "
            "process list and shell history; remove them and set AUTOTUNE_PROMETHEUS_USERNAME"
            " and AUTOTUNE_PROMETHEUS_PASSWORD(_FILE) instead (see docs/traffic.md)")
    for suffix in ("/api/v1/query", "/api/v1", "/graph"):  # a pasted API or UI URL
        if parts.path.endswith(suffix):
            u = u[: -len(suffix)]
    return u


class PrometheusClient:
    """The query API of the Prometheus at ``url`` (see the module docstring)."""

    def __init__(self, url: str, *, auth: PrometheusAuth | None = None,
                 timeout_s: float = 60.0) -> None:
        self.url = _check_base(url)
        self.auth = auth
        self.timeout_s = timeout_s
        self.requests = 0

    def _get(self, path: str, params: Sequence[tuple[str, str]]) -> Any:
        target = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        req = urllib.request.Request(target, headers={"Accept": "application/json"})
        header = self.auth.header() if self.auth else None
        if header:
            req.add_header("Authorization", header)
        self.requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
            if exc.code in (401, 403):
                raise PrometheusError(
                    f"Prometheus at {self.url} refused the request (HTTP {exc.code}): set "
                    "its credentials in AUTOTUNE_PROMETHEUS_BEARER_TOKEN(_FILE) or "
                    "AUTOTUNE_PROMETHEUS_USERNAME/PASSWORD(_FILE)") from exc
            try:
                json.loads(body)
            except ValueError:  # not the API's JSON: a proxy's page, a wrong path
                hint = ("; is the URL the Prometheus server (its API under /api/v1)?"
                        if exc.code == 404 else "")
                error = (PrometheusUnreachableError if exc.code >= 500
                         else PrometheusError)
                raise error(f"Prometheus at {self.url} answered HTTP {exc.code} on {path}"
                            f"{hint}") from exc
            return self._decode(body, path, status=exc.code)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PrometheusUnreachableError(
                f"cannot reach Prometheus at {self.url}: {reason}; is it running and the URL "
                "right?") from exc
        return self._decode(body, path, status=200)

    def _decode(self, body: bytes, path: str, *, status: int) -> Any:
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise PrometheusError(
                f"{self.url}{path} answered HTTP {status} with something that is not "
                "Prometheus' JSON; is the URL the Prometheus server?") from exc
        if not isinstance(doc, dict) or doc.get("status") != "success":
            err = doc.get("error") if isinstance(doc, dict) else None
            kind = doc.get("errorType") if isinstance(doc, dict) else None
            raise PrometheusError(f"Prometheus at {self.url} rejected the query ({kind}: "
                                  f"{err})")
        return doc.get("data")

    def query(self, expr: str, *, at: float) -> list[Series]:
        """An instant query evaluated at unix time ``at``: its vector (or scalar)."""
        data = self._get("/api/v1/query", [("query", expr), ("time", _ts(at))])
        return _series(data)

    def query_range(self, expr: str, *, start: float, end: float, step: float) -> list[Series]:
        """A range query at ``start``, ``start + step``, ... ``<= end``; split into requests
        of at most :data:`MAX_POINTS` steps, the parts of one series joined."""
        if not (step > 0 and end >= start):
            raise TrafficError(f"a range query needs step > 0 and end >= start (got {step}, "
                               f"{start}..{end})")
        n = math.floor((end - start) / step + 1e-9) + 1
        merged: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for first in range(0, n, MAX_POINTS):
            last = min(n, first + MAX_POINTS) - 1
            data = self._get("/api/v1/query_range", [
                ("query", expr), ("start", _ts(start + first * step)),
                ("end", _ts(start + last * step)), ("step", f"{step:g}")])
            for s in _series(data):
                merged.setdefault(tuple(sorted(s.labels.items())), []).extend(s.points)
        return [Series(dict(k), v) for k, v in merged.items()]

    def series(self, match: str, *, start: float, end: float) -> list[dict[str, str]]:
        """The label sets of the series matching ``match`` that have samples in the range."""
        data = self._get("/api/v1/series", [("match[]", match), ("start", _ts(start)),
                                            ("end", _ts(end))])
        if not isinstance(data, list):
            raise PrometheusError(f"Prometheus at {self.url}: /api/v1/series answered "
                                  f"{type(data).__name__}, not a list")
        return [{str(k): str(v) for k, v in d.items()} for d in data if isinstance(d, dict)]


def _ts(t: float) -> str:
    return f"{t:.3f}"


def _point(p: Any) -> tuple[float, float]:
    return float(p[0]), float(p[1])  # Prometheus writes values as strings ("NaN" too)


def _series(data: Any) -> list[Series]:
    if not isinstance(data, dict):
        raise PrometheusError(f"Prometheus answered {type(data).__name__}, not a result")
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return [Series({}, [_point(result)])]
    if kind not in ("vector", "matrix") or not isinstance(result, list):
        raise PrometheusError(f"Prometheus answered a {kind!r} result; a vector or a matrix "
                              "was expected")
    out = []
    for item in result:
        labels = {str(k): str(v) for k, v in (item.get("metric") or {}).items()}
        pts = [_point(item["value"])] if "value" in item else [
            _point(p) for p in item.get("values") or []]
        out.append(Series(labels, pts))
    return out
