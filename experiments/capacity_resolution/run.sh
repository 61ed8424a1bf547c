#!/usr/bin/env bash
# Capacity resolution and time per trial with the defaults, on a bursty public trace fitted
# and clipped as a user does it, with the CPU build of vLLM and the tiny hybrid model.
#
#   bash experiments/capacity_resolution/run.sh [TRACE] [NAME]
#
# TRACE: an Azure LLM inference trace (default tests/data/traces/azure2023_code.csv, the
# first 900 s of the code-completion trace); NAME: the results folder under
# experiments/capacity_resolution/ (default: the trace's file name). It runs, from the
# repository root, the exact commands a new user would:
#   autotune model tiny MODEL --arch nemotron_h
#   autotune shape fit TRACE -o trace.json
#   autotune shape clip trace.json --scale-input 0.125 --max-total-tokens 2048 -o clip.json
#   autotune tune --model MODEL --shape clip.json --space search_spaces/cpu.yaml --trials 3 --recheck 0
# then summarize.py writes NAME/trials.csv (each trial's wall time, server start, warm-up,
# levels, bracket and width) and NAME/summary.json (the study's figures and the load average
# of the machine while it ran: the goal holds on a quiet machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
TRACE=${1:-tests/data/traces/azure2023_code.csv}
NAME=${2:-$(basename "$TRACE" .csv)}
DEST=experiments/capacity_resolution/$NAME
A=${AUTOTUNE:-.venv/bin/autotune}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST"
"$A" model tiny "$WORK/tiny" --arch nemotron_h > /dev/null 2>&1
"$A" shape fit "$TRACE" -o "$WORK/trace.json"
"$A" shape clip "$WORK/trace.json" --scale-input 0.125 --max-total-tokens 2048 -o "$WORK/clip.json"
cat /proc/loadavg > "$WORK/load-before"
( while sleep 5; do cut -d' ' -f1 /proc/loadavg; done ) > "$WORK/load" &
LOADPID=$!
t0=$(date +%s)
set +e
"$A" tune --model "$WORK/tiny" --shape "$WORK/clip.json" --space search_spaces/cpu.yaml \
  --trials 3 --recheck 0 --out "$WORK/out" --storage "sqlite:///$WORK/optuna.db" \
  --tracking-uri "sqlite:///$WORK/mlflow.db" --study-name capacity-resolution \
  2>&1 | tee "$WORK/tune.log"
rc=${PIPESTATUS[0]}
set -e
kill "$LOADPID" 2>/dev/null || true
.venv/bin/python experiments/capacity_resolution/summarize.py "$WORK/out/trials.csv" "$DEST" \
  --study-s $(( $(date +%s) - t0 )) --load "$WORK/load" --trace "$TRACE" \
  --commit "$(git rev-parse --short HEAD)" --exit-code "$rc"
cp "$WORK/clip.json" "$DEST/shape.json"
grep -E "^(verdict|best|capacity):|^study " "$WORK/tune.log" > "$DEST/console.txt" || true
