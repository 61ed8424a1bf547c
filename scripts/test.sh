#!/usr/bin/env bash
# The whole test suite (unit tests, real CPU vLLM servers, the fault-injection suite).
# Extra arguments go to pytest (e.g. -m "not slow" for the fast part alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${AUTOTUNE_VENV:-.venv}
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
exec "$VENV/bin/python" -m pytest -m "slow or not slow" "$@"
