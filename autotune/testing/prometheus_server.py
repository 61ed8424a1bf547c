"""A real Prometheus server for tests and demos: Debian's ``prometheus`` binary
(``scripts/setup-prometheus.sh``) on loopback, a free port, a temporary data folder, and a
scrape job per target at a short interval.

``with PrometheusServer(targets={"replica-a": "127.0.0.1:8000"}) as prom: prom.url``. Each
target is its own job, so its series carry ``job="<name>"`` and ``instance="host:port"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Self

__all__ = ["PrometheusServer", "prometheus_binary"]


def prometheus_binary() -> str | None:
    """The ``prometheus`` binary on PATH (or ``$AUTOTUNE_PROMETHEUS_BIN``), else None."""
    return os.environ.get("AUTOTUNE_PROMETHEUS_BIN") or shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """One Prometheus process scraping ``targets`` (job name -> ``host:port``) every
    ``scrape_interval_s`` seconds; stopped (SIGTERM, then SIGKILL) by :meth:`stop`."""

    def __init__(self, *, targets: Mapping[str, str], scrape_interval_s: float = 1.0,
                 data_dir: Path | None = None, port: int | None = None,
                 basic_auth: tuple[str, str] | None = None) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise FileNotFoundError("no prometheus binary: run scripts/setup-prometheus.sh "
                                    "(Debian's prometheus package)")
        self.binary = binary
        self.targets = dict(targets)
        self.interval = scrape_interval_s
        self.port = port or _free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="autotune-prom-")
        self.dir = Path(self._tmp.name)
        self.data_dir = data_dir or self.dir / "data"
        self.log_path = self.dir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.basic_auth = basic_auth

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> Path:
        lines = ["global:", f"  scrape_interval: {self.interval:g}s",
                 f"  scrape_timeout: {self.interval:g}s", "scrape_configs:"]
        for job, target in self.targets.items():
            lines += [f"  - job_name: {job!r}", "    static_configs:",
                      f"      - targets: [{target!r}]"]
        path = self.dir / "prometheus.yml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def _web_config(self) -> list[str]:
        """``--web.config.file`` asking for basic auth (a bcrypt hash, as Prometheus wants)."""
        if self.basic_auth is None:
            return []
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # libxcrypt's bcrypt; the module is in Python up to 3.12

        user, password = self.basic_auth
        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
        if not hashed or not hashed.startswith("$2"):
            raise RuntimeError("this system's crypt() has no bcrypt: no basic auth")
        path = self.dir / "web.yml"
        path.write_text(f"basic_auth_users:\n  {user}: '{hashed}'\n")
        return [f"--web.config.file={path}"]

    def _request(self, path: str) -> urllib.request.Request:
        req = urllib.request.Request(self.url + path)
        if self.basic_auth is not None:
            import base64

            pair = base64.b64encode(":".join(self.basic_auth).encode()).decode()
            req.add_header("Authorization", f"Basic {pair}")
        return req

    def _ready(self) -> bool:
        with (contextlib.suppress(OSError),
              urllib.request.urlopen(self._request("/-/ready"), timeout=2) as r):
            return bool(r.status == 200)
        return False

    def _jobs_up(self) -> set[str]:
        """The jobs whose last scrape succeeded (``up == 1``)."""
        with (contextlib.suppress(OSError, ValueError, KeyError, TypeError),
              urllib.request.urlopen(self._request("/api/v1/query?query=up"),
                                     timeout=2) as r):
            result = json.load(r)["data"]["result"]
            return {str(s["metric"].get("job")) for s in result if s["value"][1] == "1"}
        return set()

    def wait_scraped(self, timeout_s: float = 60.0) -> None:
        """Return once every target has been scraped successfully.

        Ready is not scraping: Prometheus' discovery manager passes the targets on, and its
        scrape manager starts their pools, each on its own 5-s ticker, so the first sample
        lands 5 to 10 s after ``/-/ready`` (then a scrape offset within the interval). A
        range that starts from the caller's clock before that has no sample at its start."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._jobs_up() >= set(self.targets):
                return
            time.sleep(0.2)
        raise TimeoutError(f"prometheus at {self.url}: not every target scraped after "
                           f"{timeout_s:g} s (up: {sorted(self._jobs_up())} of "
                           f"{sorted(self.targets)}); see {self.log_path}")

    def start(self, timeout_s: float = 60.0) -> None:
        cmd = [self.binary, f"--config.file={self._config()}", *self._web_config(),
               f"--storage.tsdb.path={self.data_dir}",
               f"--web.listen-address=127.0.0.1:{self.port}",
               "--storage.tsdb.retention.time=1d", "--log.level=warn"]
        log = self.log_path.open("ab")
        from autotune.engine._vllm import _set_pdeathsig

        # its own process group, and it dies with the process that started it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_set_pdeathsig)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}): "
                                   f"{self.log_path.read_text()[-2000:]}")
            if self._ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"prometheus at {self.url} not ready after {timeout_s:g} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._tmp.cleanup()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
