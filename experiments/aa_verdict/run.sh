#!/usr/bin/env bash
# A/A test of the verdict: vLLM's defaults against the defaults' own flags enqueued as the
# only candidate (both configs are the same server), N studies in a row; each study's
# verdict goes to RESULTS (one JSON line per study). README.md holds the rule.
#
#   bash experiments/aa_verdict/run.sh MODE N [RESULTS]
#
# MODE: recheck0 (example-chat, --recheck 0: one start each), default (example-chat, the
# default study settings: --recheck 3 --recheck-starts 2), capacity (the committed
# code-trace excerpt fitted and clipped as a user does it, --objective capacity, default
# settings) or capacity0 (the same with --recheck 0). N: studies to run. RESULTS: default
# experiments/aa_verdict/results/MODE.jsonl (appended to: runs add up). With LOCK=FILE
# each study runs under 'flock FILE' (one server at a time on a shared machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:?MODE: recheck0, default, capacity or capacity0}
N=${2:?N: how many studies}
RESULTS=${3:-experiments/aa_verdict/results/$MODE.jsonl}
A=${AUTOTUNE:-.venv/bin/autotune}
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$(dirname "$RESULTS")"
"$A" model tiny "$WORK/tiny" --arch nemotron_h > /dev/null 2>&1
case "$MODE" in
  recheck0|default) SHAPE=traffic/example-chat.json; EXTRA=(--precision 0.05 --warmup-max-s 30 --measure-max-s 30) ;;
  capacity|capacity0)
    "$A" shape fit tests/data/traces/azure2023_code.csv -o "$WORK/code.json" > /dev/null
    "$A" shape clip "$WORK/code.json" --scale-input 0.125 --max-total-tokens 2048 \
      -o "$WORK/shape.json" > /dev/null
    SHAPE=$WORK/shape.json; EXTRA=(--objective capacity) ;;
  *) echo "unknown MODE $MODE: use recheck0, default, capacity or capacity0" >&2; exit 2 ;;
esac
case "$MODE" in recheck0|capacity0) EXTRA+=(--recheck 0) ;; esac
# the candidate: the defaults' own knob values (the baseline trial's params), not marked as
# the baseline, so the study holds two configs that start the same server
PARAMS=$("$PY" - "$WORK/tiny" <<'PYEOF'
import json, sys
from autotune.space import load_space
from autotune.space import ModelFacts
space = load_space("search_spaces/cpu.yaml", facts=ModelFacts.from_model_dir(sys.argv[1], device="cpu"))
print(json.dumps(space.baseline_params()))
PYEOF
)
for i in $(seq 1 "$N"); do
  name="aa-$MODE-$(date -u +%Y%m%d-%H%M%S)-$i"
  out="$WORK/$name"
  t0=$(date +%s)
  set +e
  ${LOCK:+flock "$LOCK"} "$A" tune --model "$WORK/tiny" --shape "$SHAPE" \
    --space search_spaces/cpu.yaml --trials 2 --enqueue "$PARAMS" --no-quality-probe \
    --study-name "$name" --out "$out" "${EXTRA[@]}" -q > "$WORK/$name.log" 2>&1
  rc=$?
  set -e
  "$PY" experiments/aa_verdict/summarize.py record "$out" --mode "$MODE" --exit-code "$rc" \
    --seconds $(( $(date +%s) - t0 )) --commit "$(git rev-parse --short HEAD)" \
    --load "$(cut -d' ' -f1 /proc/loadavg)" --log "$WORK/$name.log" >> "$RESULTS"
  tail -n 1 "$RESULTS"
done
