"""A real MLflow tracking server for tests: ``mlflow server`` with a PostgreSQL backend
store, an artifact destination, and MLflow's basic-auth app (its users in PostgreSQL too).

The admin user (``ADMIN``, :attr:`MlflowServer.password`) is created by the auth app on its
first start (``MLFLOW_AUTH_ADMIN_PASSWORD``); clients log with ``MLFLOW_TRACKING_USERNAME``
and ``MLFLOW_TRACKING_PASSWORD``. The server's database password comes from ``PGPASSWORD``
(never in its command line). ``stop()`` / ``start()`` restart it on the same port.
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from autotune.engine import free_port

ADMIN = "admin"


class MlflowServer:
    def __init__(self, root: Path, *, backend_uri: str, auth_db_uri: str,
                 pg_password: str) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = "mlflow-" + secrets.token_hex(8)
        self.backend_uri = backend_uri
        self.artifacts = root / "artifacts"
        self.log = root / "mlflow-server.log"
        ini = root / "basic_auth.ini"
        ini.write_text(
            "[mlflow]\ndefault_permission = READ\n"
            f"database_uri = {auth_db_uri}\nadmin_username = {ADMIN}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
        self.env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(ini),
                    "MLFLOW_AUTH_ADMIN_PASSWORD": self.password, "PGPASSWORD": pg_password,
                    # the auth app's CSRF key: the same across restarts
                    "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
                    # autotune runs no MLflow jobs: no job runner and its consumer processes
                    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            self.env.pop(k, None)
        self.proc: subprocess.Popen[bytes] | None = None

    def client_env(self) -> dict[str, str]:
        """What a client sets to log as the admin."""
        return {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": self.password}

    def start(self, timeout_s: float = 240) -> None:
        argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
                "--port", str(self.port), "--backend-store-uri", self.backend_uri,
                "--artifacts-destination", str(self.artifacts), "--app-name", "basic-auth",
                "--workers", "1"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log,
                                         cwd=self.root, start_new_session=True)
        # healthy, and past its first (slow) authenticated request
        wait_http(f"{self.url}/api/2.0/mlflow/experiments/search?max_results=1", self.proc,
                  self.log, timeout_s, headers={"Authorization": "Basic " + base64.b64encode(
                      f"{ADMIN}:{self.password}".encode()).decode()})

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float,
              headers: dict[str, str] | None = None) -> None:
    """Until ``url`` answers 200 (each try may take a minute on a loaded machine); raises
    with the end of ``log`` when ``proc`` exits or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            req = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(req, timeout=60) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer in {timeout_s} s:\n{log.read_text()[-3000:]}")
