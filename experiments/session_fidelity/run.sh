#!/usr/bin/env bash
# One CPU vLLM server (tiny llama): the exact replay of the Mooncake excerpt, then the
# fitted session replay of its shape with 3 seeds (README.md).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
exec "$py" "$here/run.py" --out "$here/results.json" "$@"
