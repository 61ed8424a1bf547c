#!/usr/bin/env bash
# One CPU vLLM server (tiny llama, prefix caching on): per trace, the exact replay (hash-id
# traces), the uncompressed fitted replays and the bounded session levels (README.md).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
exec "$py" "$here/run.py" --out "$here/results.json" "$@"
