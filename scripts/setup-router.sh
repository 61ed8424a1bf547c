#!/usr/bin/env bash
# Install vLLM's router (the `vllm-router` wheel from PyPI: a Rust load balancer with an admin
# API, /add_worker, /remove_worker, /list_workers) into the project's virtualenv, for
# `autotune rollout` and its tests (tests/integration/test_rollout.py). Idempotent: skipped when the
# `vllm-router` command is already there. Its Python dependencies (aiohttp, fastapi, uvicorn,
# orjson, requests, setproctitle) come with vLLM, so nothing else is resolved again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AUTOTUNE_VENV:-.venv}
VERSION=${VLLM_ROUTER_VERSION:-0.1.17}
if [ -x "$VENV/bin/vllm-router" ]; then
  exit 0
fi
echo "[setup] installing vllm-router $VERSION (vLLM's router, for 'autotune rollout')"
if [ -x "$VENV/bin/uv" ]; then
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "vllm-router==$VERSION"
else
  "$VENV/bin/python" -m pip install -q "vllm-router==$VERSION"
fi
