#!/usr/bin/env bash
# The synthetic think-time trace, its shape, a tiny llama, then 3 session capacity benches
# of vLLM's defaults, each its own server start (README.md).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
runs="${RUNS:-3}"
first="${FIRST:-1}"  # the number of the first run (results/run-N.json)
work="$(mktemp -d)"
mkdir -p "$here/results"
"$py" "$here/gen_trace.py" "$work/think90.jsonl" --seed 0
"$py" -m autotune shape fit "$work/think90.jsonl" --name think90 -o "$here/results/think90.json"
"$py" -m autotune model tiny --arch llama "$work/tiny-llama"
for i in $(seq "$first" $((first + runs - 1))); do
  t0=$(date +%s.%N)
  "$py" -m autotune bench --model "$work/tiny-llama" --shape "$here/results/think90.json" \
    --capacity --json -- --max-model-len 2048 -O0 > "$work/run-$i.json" || true
  t1=$(date +%s.%N)
  "$py" - "$work/run-$i.json" "$here/results/run-$i.json" "$t0" "$t1" <<'PY'
import json, sys
src, dst, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
out = json.loads(open(src).read() or "{}")
out["command_wall_s"] = round(t1 - t0, 1)
open(dst, "w").write(json.dumps(out, indent=1) + "\n")
PY
done
