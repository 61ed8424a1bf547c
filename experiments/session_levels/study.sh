#!/usr/bin/env bash
# The 4-trial study over search_spaces/multiturn.yaml on the think-90 s trace's shape, with
# prefix caching on (vLLM's defaults, trial 0) and off (enqueued) among its trials, run to
# its verdict (README.md, "The study"). Writes results/study-*.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
work="$(mktemp -d)"
"$py" -m autotune model tiny --arch llama "$work/tiny-llama" || exit 2
t0=$(date +%s)
"$py" -m autotune tune --model "$work/tiny-llama" --shape "$here/results/think90.json" \
  --space "$root/search_spaces/multiturn.yaml" --trials 4 --seed 0 --no-ray \
  --enqueue '{"enable_prefix_caching": false}' --recheck 1 --recheck-starts 1 \
  --timeout 1500 --out "$work/study" > "$work/study.log" 2>&1
rc=$?
t1=$(date +%s)
echo "exit status $rc, $((t1 - t0)) s" >> "$work/study.log"
cp "$work/study.log" "$here/results/study.log"
for f in trials.csv best.json; do
  [ -f "$work/study/$f" ] && cp "$work/study/$f" "$here/results/study-$f"
done
exit "$rc"
