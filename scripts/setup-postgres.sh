#!/usr/bin/env bash
# PostgreSQL for a shared Optuna storage and an MLflow backend store (docs/team.md), and for
# the tests that run autotune against them (tests/_postgres.py starts its own cluster from
# these binaries: initdb in a temporary folder, a free port on 127.0.0.1, a password).
# Debian's package; idempotent: skipped when initdb is already there, and where apt-get is
# not ours to run (the tests that need it then skip with the reason).
set -euo pipefail
have_pg() {
  command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
}
if have_pg; then
  exit 0
fi
if [ "${AUTOTUNE_NO_POSTGRES:-}" = 1 ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing Debian's postgresql (a shared Optuna storage and its tests; apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # the package's own cluster is not started here: a team starts its server as docs/team.md says
  if ! apt-get install -y -qq postgresql >/dev/null 2>&1; then
    apt-get update -qq >/dev/null  # an old or missing package list: refresh it only then
    apt-get install -y -qq postgresql >/dev/null
  fi
else
  echo "[setup] note: no PostgreSQL and no root apt-get here: the PostgreSQL tests will skip" \
    "(install Debian's postgresql package to run them)"
fi
