"""A real PostgreSQL cluster for tests: initdb in a temporary folder, a free port on
127.0.0.1, password authentication (scram-sha-256) for its superuser ``autotune``.

The binaries are Debian's (``scripts/setup-postgres.sh`` installs them). PostgreSQL refuses
to run as root: as root (CI) the cluster belongs to the ``postgres`` user and its commands
run through ``runuser``. :func:`pg_binaries` is None where none is installed (tests skip).
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

from autotune.engine import free_port

USER = "autotune"


def pg_binaries() -> Path | None:
    """The folder of initdb/pg_ctl (the newest Debian version), None when not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class PgCluster:
    """``start()``, ``restart()``, ``stop()``; ``url(db)`` without the password (it is
    :attr:`password`, for ``PGPASSWORD``), ``url(db, with_password=True)`` with it."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.password = "pw-" + secrets.token_hex(8)
        self.port = free_port()
        self._root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
        self.data = self._root / "data"
        self.log = self._root / "server.log"
        self._as: list[str] = []
        if os.geteuid() == 0:  # postgres will not run as root: the cluster is postgres's
            self._as = ["runuser", "-u", "postgres", "--"]
            shutil.chown(self._root, "postgres", "postgres")
        pwfile = self._root / "pw"
        pwfile.write_text(self.password + "\n")
        if self._as:
            shutil.chown(pwfile, "postgres", "postgres")
        try:
            self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=scram-sha-256",
                      f"--pwfile={pwfile}", "--no-sync", "-E", "UTF8")
        finally:
            pwfile.unlink()

    def _run(self, tool: str, *args: str) -> str:
        out = subprocess.run([*self._as, str(self.bindir / tool), *args], capture_output=True,
                             text=True, timeout=120, cwd=self._root)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr[-2000:]}\n"
                               f"{self.log.read_text()[-2000:] if self.log.exists() else ''}")
        return out.stdout

    def start(self) -> None:
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories='' "
                "-c fsync=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-o", opts, "start")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, db: str, *, with_password: bool = False) -> str:
        auth = f"{USER}:{self.password}" if with_password else USER
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{db}"

    def create_db(self, name: str) -> str:
        """A fresh database ``name``; returns its URL (no password)."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER,
                             password=self.password, dbname="postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def remove(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self._root, ignore_errors=True)
