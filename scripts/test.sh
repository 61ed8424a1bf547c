#!/usr/bin/env bash
# The whole test suite (unit tests, real CPU vLLM servers, the fault-injection suite).
# Extra arguments go to pytest (e.g. -m "not slow" for the fast part alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${AUTOTUNE_VENV:-.venv}
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
# Two test processes (pytest-xdist), a file per process at a time: most tests wait on a
# vLLM server, so two at once took 26.5 min where one took 42 (2 cores). Files share their
# module and session fixtures (the tiny server starts once per process). The slowest files
# go first (tests/conftest.py SLOW_FILES; --no-loadscope-reorder keeps that order: xdist
# would order the files by their number of tests and start the study end to end, the
# longest file, late; pytest took 18.4 and 22.3 min so, 26.7 min the run before without it).
# AUTOTUNE_TEST_WORKERS=0 runs everything in this process.
exec "$VENV/bin/python" -m pytest -m "slow or not slow" -n "${AUTOTUNE_TEST_WORKERS:-2}" \
  --dist loadfile --no-loadscope-reorder "$@"
