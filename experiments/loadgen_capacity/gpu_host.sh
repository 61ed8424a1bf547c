#!/usr/bin/env bash
# The capacity benchmark on the lent H200 host's CPUs (16 cores), one command from the repo root:
#   bash experiments/loadgen_capacity/gpu_host.sh STAGING_DIR OUT_DIR MODE [REPEATS]
# STAGING_DIR holds the wheel parts made by scripts/gpu/make_bundle.py (installed once; vLLM's
# client needs vLLM); MODE is interleaved or burst. The client gets one core, the stub 8
# processes on 8 other cores (none the client's hyperthread sibling), so the stub is not
# the limit, which a 2-core machine cannot show.
set -uo pipefail
STAGE=${1:?staging dir}; OUT=${2:?out dir}; MODE=${3:?interleaved or burst}; REPEATS=${4:-3}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
SITE=$HOME/site
if [ ! -d "$SITE/vllm" ]; then
  ( time bash "$STAGE/install.sh" "$STAGE" "$SITE" ) > "$OUT/install.txt" 2>&1 || { tail -20 "$OUT/install.txt"; exit 3; }
fi
export PYTHONPATH=$SITE:$PWD
ulimit -n "$(ulimit -Hn)"
CLIENT=1
SIBLINGS=$(cat /sys/devices/system/cpu/cpu$CLIENT/topology/thread_siblings_list 2>/dev/null || echo $CLIENT)
STUBS=$(python3 - "$SIBLINGS" <<'PY'
import os, sys
busy = {0}
for part in sys.argv[1].split(","):
    a, _, b = part.partition("-")
    busy |= set(range(int(a), int(b or a) + 1))
free = [c for c in sorted(os.sched_getaffinity(0)) if c not in busy]
# one core per physical core where we can: skip the siblings of those already taken
out = []
for c in free:
    try:
        sib = open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip()
    except OSError:
        sib = str(c)
    if not any(str(o) in sib.replace("-", ",").split(",") for o in out):
        out.append(c)
print(" ".join(map(str, out[:8])))
PY
)
{
  echo "client core $CLIENT (siblings $SIBLINGS); stub cores $STUBS"
  nproc; lscpu | grep -E "Model name|Thread|Core|Socket|MHz" ; uname -r
  python3 -c "import sys, importlib.metadata as m; print(sys.version); [print(p, m.version(p)) for p in ('vllm','aiohttp','uvloop','msgspec')]"
  ulimit -n; which taskset
} > "$OUT/env-$MODE.txt" 2>&1
cat "$OUT/env-$MODE.txt"
if [ ! -f models/tiny-llama/tokenizer.json ]; then
  python3 -m autotune model tiny models/tiny-llama --arch llama > "$OUT/model.txt" 2>&1 || { tail "$OUT/model.txt"; exit 4; }
fi
# shellcheck disable=SC2086
python3 experiments/loadgen_capacity/run.py --client-core $CLIENT --stub-cores $STUBS \
  --stub-modes "$MODE" --repeats "$REPEATS" --out-dir "$OUT/$MODE" 2>&1 | tee "$OUT/$MODE.log" | grep -v '^- \*\*'
