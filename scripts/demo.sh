#!/usr/bin/env bash
# The main job on a CPU machine: set up, generate a tiny hybrid (Mamba2 + attention) model,
# and run a real tuning study (CPU vLLM servers, Optuna + MLflow on SQLite, local Ray) on the
# example traffic shape: three trials, then the leader and the defaults once more on fresh
# servers (a verdict never rests on one server start of each). Extra arguments go to
# 'autotune tune' (e.g. --trials 6).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${AUTOTUNE_VENV:-.venv}
if [ ! -f models/tiny-hybrid/config.json ]; then
  "$VENV/bin/autotune" model tiny models/tiny-hybrid --arch nemotron_h
fi
name="demo-$(date -u +%Y%m%d-%H%M%S)"
exec "$VENV/bin/autotune" tune \
  --model models/tiny-hybrid \
  --shape traffic/example-chat.json \
  --space search_spaces/cpu.yaml \
  --trials 3 --recheck 1 --recheck-starts 1 \
  --precision 0.05 --warmup-max-s 30 --measure-max-s 30 \
  --study-name "$name" \
  --out "experiments/demo/$name" \
  "$@"
