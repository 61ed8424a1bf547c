#!/usr/bin/env bash
# Second half of the 2026-12-01 x2 session, after proof-x2.sh's 32-stream study (the
# study's fused-MoE kernel tuning took 212 s that the plan had not counted, so the
# 256-stream study no longer fitted): 1. the 32 study's independent re-measure, both configs
# at once, each on the GPU its re-check did not use; 2. at 256 streams, vLLM's defaults
# (GPU 0) and cudagraph_cover_prefill (capture 768, GPU 1) at once, two adaptive
# measurements each on one server (`bench --repeats 2`): the defaults' repeat-to-repeat
# spread and a one-start ratio.  bash experiments/h200-trust/after-c32.sh RES_DIR
set -uo pipefail
RES=${1:?results dir}; export PYTHONPATH=$HOME/site:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
MODEL=$HOME/models/nemotron3-nano-30b-a3b-mtp; CACHE=$HOME/.cache/autotune; RUN=$HOME/run
SHAPE=traffic/casestudy-512x512.json; CFG=$RES/c32/configs.json
phase() { echo "$(date -u +%H:%M:%S) $*" >> "$RES/progress.txt"; }
field() { python3 -c "import json,sys;d=json.load(open('$CFG')).get('$1') or {};exec(sys.argv[1])" "$2"; }
bench() {  # OUTNAME GPU CONC MEASURE WARMUP REPEATS FLAGS...
  local name=$1 gpu=$2 conc=$3 meas=$4 warm=$5 reps=$6; shift 6
  CUDA_VISIBLE_DEVICES=$gpu timeout 560 python3 -m autotune bench --model "$MODEL" --shape "$SHAPE" \
    --concurrency "$conc" --cache-dir "$CACHE" --precision 0.02 --measure-max-s "$meas" \
    --warmup-max-s "$warm" --repeats "$reps" --start-timeout 420 --log "$RUN/bench-$name.log" --json \
    -- "$@" > "$RES/$name.json" 2> "$RES/$name.err"
  phase "bench $name on gpu$gpu exit $?"
}
mkdir -p "$RUN/bench-c32"
mapfile -t CAND < <(field candidate "[print(f) for f in d.get('flags', [])]")
mapfile -t DEF < <(field defaults "[print(f) for f in d.get('flags', [])]")
gc=$(field candidate "s=[x for x in d.get('slots',[]) if x];print(1 if s and s[-1]=='gpu0' else 0)")
if [ -z "${SKIP_C32:-}" ]; then  # SKIP_C32=1: proof-x2.sh already re-measured them
  phase "c32 re-measure: candidate on gpu$gc, defaults on gpu$((1 - gc))"
  bench c32/bench-candidate "$gc" 32 60 30 1 "${CAND[@]}" & bench c32/bench-defaults $((1 - gc)) 32 60 30 1 "${DEF[@]}" & wait
fi
M=${M:-120}; W=${W:-60}; R=${R:-2}
C256=("${DEF[@]}" --max-cudagraph-capture-size 768)
bench c256-defaults-r$R 0 256 "$M" "$W" "$R" "${DEF[@]}" & bench c256-cover-r$R 1 256 "$M" "$W" "$R" "${C256[@]}" & wait
mkdir -p "$RUN/tails" && for f in "$RUN"/bench-*.log "$RUN"/bench-c32/*.log; do
  [ -f "$f" ] && { head -c 20000 "$f"; echo; echo "[...]"; tail -c 30000 "$f"; } > "$RUN/tails/$(basename "$f")"; done
tar czf "$RES/bench-logs.tgz" -C "$RUN" tails 2>/dev/null
phase after-done; touch "$RES/AFTER_DONE"
