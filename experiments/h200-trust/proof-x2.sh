#!/usr/bin/env bash
# Issue 14's H200 proof on an nvidia-h200-x2 (one trial per GPU), one background job from
# the repo root:
#   setsid nohup bash experiments/h200-trust/proof-x2.sh STAGING_DIR RES_DIR SECONDS_LEFT &
# 1. study at 32 streams (cold compile caches: this machine is fresh), 2. study at 256
#    streams (warm caches, as a user's next study), each: trial 0 = vLLM's defaults,
#    trial 1 = `cudagraph_cover_prefill` (the only other config: the 12-minute budget holds
#    two configs and their re-checks), --recheck 1 --recheck-starts 1, one trial per GPU;
#    every config is re-checked, so each has two starts (search + fresh) in the verdict;
# 3. the independent re-measure (`autotune bench`, fresh servers) of both configs of the
#    256 study, each on the GPU its re-check did not use, both at once; 4. the same for the
#    32 study while SECONDS_LEFT allows. Step prune256 (not in the default STEPS): the
#    pruner's saving, the case study's recipe enqueued after the defaults at 256 streams.
# Results per phase under RES_DIR/<phase>/ (study files, bench JSON, server-log tails) and
# GPU clocks/power of both GPUs every second (gpu.csv). Knobs (environment): M32/W32,
# M256/W256 (measure/warm-up caps, s), B32/B256/BPRUNE (study budgets, s), ENQ32 (the 32-stream
# study's second config, `--enqueue` syntax; default cudagraph_cover_prefill), SPACE (search space;
# experiments/h200-trust/space-no-moe.yaml leaves out moe_config, whose kernel tuning before
# trial 0 took 212 s of device time on this machine), STEPS (default "c32 c256 c256bench
# c32bench"), PREC (the studies' --precision, default 0.02), SEG (--segment-requests of
# the studies and benches; default max(streams, 16)), ENQ256 (the 256-stream study's second
# config, default cudagraph_cover_prefill), SUFFIX (appended to the study
# names and result folders, e.g. -warm), RUN_DIR (the stores and server logs; default ~/run:
# give a second job on the machine its own).
# One GPU (`nvidia-h200`): the study runs one trial at a time and the two re-measure benches
# run one after the other on that GPU (fresh servers, no "other GPU" to use); BENCH_ROLES
# (default "candidate defaults") picks which of the two; a role named twice gets a second
# fresh server (its files tagged ROLE-2, ...). BREPEATS: each bench's --repeats (default 1):
# more than one measures on the same server again, the streams staggered anew each time.
# BJITTER: the benches' --output-jitter (default autotune's, 0.1; 0: the exact lengths).
# A bench starts when a start, its warm-up and one repeat fit in the time left; it is sent
# SIGTERM 25 s before the deadline and reports what it measured by then (exit 130).
# M32=auto: the 32-stream study's measuring cap from the time left when it starts, so that
# its four trials (two configs, two starts each) end before the deadline (at most MCAP s).
# Step warm (a fresh machine without carried caches): starts each config of PRE_CONFIGS (a
# configs.json of the same space, e.g. results-prune256/configs.json: the defaults and the
# case study's recipe) once, with `autotune bench` (a short warm-up and one measured
# segment at 32 streams), so that the study after it starts warm, as a user's second study
# does; its device time is the warm step's, apart from the study's account.
# Step startmethod: PRE_CONFIGS' candidate started with vLLM's `spawn` and with autotune's
# `fork` for the engine process (start seconds and throughput of each), after timing vLLM's
# flag surface read into the cache and read back (results under RES_DIR/start/).
# Step preload: PRE_CONFIGS' defaults started plainly, then three times forked from a
# preloaded interpreter (seconds to healthy, vLLM's start phases; RES/preload/starts.json).
# Step imports: times `import vllm.entrypoints.openai.api_server` twice (what each server
# start spends before vLLM's first log line) and keeps the 40 slowest imports (importtime.txt).
# Compile caches: parts named cache-part-* in STAGING_DIR (an earlier session's, staged like
# the bundle) are unpacked into the cache before the first step; the step `caches` packs the
# cache into 15 MB parts under ~/res-cache for poll.sh to bring back (e.g. STEPS="c256 caches
# c256bench").
set -uo pipefail
STAGE=${1:?staging dir}; RES=${2:?results dir}; LEFT=${3:?seconds of device time left}
DEADLINE=$(( $(date +%s) + LEFT ))
SUFFIX=${SUFFIX:-}; SPACE=${SPACE:-search_spaces/hybrid-mtp.yaml}; STEPS=${STEPS:-c32 c256 c256bench c32bench}
PREC=${PREC:-0.02}; MCAP=${MCAP:-135}
SEGARG=(); [ -n "${SEG:-}" ] && SEGARG=(--segment-requests "$SEG")  # studies' and benches' segments
M32=${M32:-60}; W32=${W32:-30}; M256=${M256:-150}; W256=${W256:-60}; B32=${B32:-480}; B256=${B256:-540}; BPRUNE=${BPRUNE:-600}
mkdir -p "$RES"; RES=$(cd "$RES" && pwd); echo $$ > "$RES/pid"  # poll.sh waits only while this runs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1
SITE=$HOME/site
left() { echo $(( DEADLINE - $(date +%s) )); }
# within CAP MARGIN: a command's time limit, CAP seconds at most, ending MARGIN seconds
# before the deadline, so the server-log tails are still packed when the device time ends
within() { local t=$(( $(left) - $2 )); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo "$t"; }
phase() { echo "$(date -u +%H:%M:%S) left=$(( DEADLINE - $(date +%s) )) $*" >> "$RES/progress.txt"; }
phase start
touch "$HOME/.job-t0"  # what this job writes outside its folders: new-files.txt at the end
if [ ! -d "$SITE/vllm" ]; then
  ( time bash "$STAGE/install.sh" "$STAGE" "$SITE" ) > "$RES/env.txt" 2>&1 || { phase install-failed; touch "$RES/DONE"; exit 3; }
fi
export PYTHONPATH=$SITE:$PWD
python3 - >> "$RES/env.txt" 2>&1 <<'PY'
import importlib.metadata as m, torch
for p in ("vllm", "torch", "optuna", "ray", "mlflow", "flashinfer-python", "transformers"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)
print("gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >> "$RES/env.txt" 2>&1
nvidia-smi topo -m >> "$RES/env.txt" 2>&1
MODEL=$HOME/models/nemotron3-nano-30b-a3b-mtp
if [ ! -f "$MODEL/tokenizer.json" ]; then
  mkdir -p "$MODEL" && cp experiments/h200/model/config.json "$MODEL/"
  python3 -c "
from pathlib import Path; from autotune.modelgen import write_tokenizer
write_tokenizer(Path('$MODEL'), vocab_size=131072)" >> "$RES/env.txt" 2>&1 || { phase model-failed; touch "$RES/DONE"; exit 4; }
fi
phase installed
phase "$(bash experiments/gpu-bytecode.sh "$SITE")"  # once, where the image writes no .pyc
RUN=${RUN_DIR:-$HOME/run}; CACHE=$HOME/.cache/autotune; mkdir -p "$RUN" "$HOME/res-cache"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if ls "$STAGE"/cache-part-* >/dev/null 2>&1; then  # compile caches an earlier session brought back
  phase "$(bash experiments/gpu-caches.sh restore "$STAGE" "$CACHE" "$SITE")"
fi
phase "gpus $NGPU"
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used \
  --format=csv,nounits -l 1 > "$RES/gpu.csv" 2>/dev/null &
SMI=$!
SHAPE=traffic/casestudy-512x512.json
COVER='{"cudagraph_cover_prefill": true}'

study() {  # NAME CONC BUDGET MEASURE WARMUP [ENQUEUE [RECHECK]]
  local name=$1 conc=$2 budget=$3 meas=$4 warm=$5 enq=${6:-$COVER} rc=${7:-1} out=$RES/$1
  mkdir -p "$out"; phase "study $name"
  timeout --signal=TERM --kill-after=20 "$(within $((budget + 420)) 40)" python3 -m autotune -v tune \
    --model "$MODEL" --shape "$SHAPE" --concurrency "$conc" --space "$SPACE" \
    --trials 2 --budget "$budget" --enqueue "$enq" --recheck "$rc" --recheck-starts 1 \
    --precision "$PREC" --measure-max-s "$meas" --warmup-max-s "$warm" --no-quality-probe \
    --storage "sqlite:///$RUN/autotune.db" --tracking-uri "sqlite:///$RUN/mlflow.db" \
    --study-name "$name" --out "$RUN/$name" --cache-dir "$CACHE" \
    --start-timeout 480 --request-timeout 240 --seed 0 ${SEGARG[@]+"${SEGARG[@]}"} > "$out/tune.log" 2>&1
  echo "tune exit code $?" >> "$out/tune.log"
  cp "$RUN/$name"/best.json "$RUN/$name"/trials.csv "$RUN/$name"/study.json "$out"/ 2>/dev/null
  # both configs' flags and env, and the GPU each one's re-check used
  python3 - "$RUN/autotune.db" "$name" > "$out/configs.json" 2>>"$out/tune.log" <<'PY'
import json, sys, optuna
s = optuna.load_study(study_name=sys.argv[2], storage=f"sqlite:///{sys.argv[1]}")
out = {}
for t in s.trials:
    if t.user_attrs.get("autotune.recheck_of") is not None or t.number > 1 or not t.user_attrs.get("autotune.flags"):
        continue
    role = "defaults" if t.user_attrs.get("autotune.baseline") else "candidate"
    out[role] = {"number": t.number, "flags": t.user_attrs.get("autotune.flags", []),
                 "env": t.user_attrs.get("autotune.env", {}), "slots": []}
for t in s.trials:
    of = t.user_attrs.get("autotune.recheck_of", t.number)
    for d in out.values():
        if d["number"] == of:
            d["slots"].append((t.user_attrs.get("autotune.time") or {}).get("slot"))
print(json.dumps(out))
PY
  phase "study $name done"
}

bench() {  # PHASE ROLE CONC MEASURE WARMUP [TAG [KEY=VALUE]]: on the GPU the role's re-check
  # did not use; TAG names the output files (default the role), KEY=VALUE adds to the env
  local ph=$1 role=$2 conc=$3 meas=$4 warm=$5 tag=${6:-$2} flags=() envs=() gpu
  [ -n "${7:-}" ] && envs+=(--env "$7")
  local cfg=$RES/$ph/configs.json
  mapfile -t flags < <(python3 -c "import json;d=json.load(open('$cfg')).get('$role') or {};[print(f) for f in d.get('flags', [])]")
  while IFS= read -r kv; do envs+=(--env "$kv"); done < <(python3 -c "import json;d=json.load(open('$cfg')).get('$role') or {};[print(f'{k}={v}') for k,v in d.get('env', {}).items()]")
  gpu=$(python3 -c "import json;d=json.load(open('$cfg')).get('$role') or {};s=[x for x in d.get('slots',[]) if x];print(1 if s and s[-1]=='gpu0' else 0)")
  [ "$NGPU" -ge 2 ] || gpu=0
  [ ${#flags[@]} -gt 0 ] || { phase "bench $ph $role: no config"; return; }
  # its limit fits a cold start (420 s) and every repeat; SIGTERM at the limit keeps what
  # it measured (the twenty-third session lost two cold benches to a fixed 560 s limit)
  local cap=$(( 420 + warm + ${BREPEATS:-1} * (meas + 30) + 60 ))
  CUDA_VISIBLE_DEVICES=$gpu timeout --kill-after=30 "$(within "$cap" 25)" python3 -m autotune bench --model "$MODEL" --shape "$SHAPE" \
    --concurrency "$conc" --cache-dir "$CACHE" --precision 0.02 --measure-max-s "$meas" \
    --warmup-max-s "$warm" --repeats "${BREPEATS:-1}" ${BJITTER:+--output-jitter "$BJITTER"} --start-timeout 420 --log "$RUN/bench-$ph-$tag.log" --json \
    ${SEGARG[@]+"${SEGARG[@]}"} "${envs[@]}" -- "${flags[@]}" > "$RES/$ph/bench-$tag-gpu$gpu.json" 2> "$RES/$ph/bench-$tag.err"
  phase "bench $ph $tag on gpu$gpu exit $?"
}

logtails() {  # PHASE: head and tail of each server log of that phase
  local ph=$1 d=$RUN/logtails-$1; mkdir -p "$d"
  for f in "$RUN/$ph"/logs/*.log "$RUN"/bench-"$ph"-*.log; do
    [ -f "$f" ] && { head -c 20000 "$f"; echo; echo "[...]"; tail -c 30000 "$f"; } > "$d/$(basename "$f")"; done
  tar czf "$RES/$ph/server-logs.tgz" -C "$RUN" "logtails-$ph" 2>/dev/null
}

for step in $STEPS; do
  case $step in
    warm)
      mkdir -p "$RES/warm"; cp "${PRE_CONFIGS:?PRE_CONFIGS: the configs.json to warm}" "$RES/warm/configs.json"
      for role in defaults candidate; do
        if [ "$(left)" -gt 400 ]; then bench warm "$role" 32 10 15; else phase "warm $role skipped: not enough device time left"; fi
      done
      logtails warm ;;
    c32)
      m=$M32
      if [ "$m" = auto ]; then  # four trials of ~(85 s start + W32 + m + 8), Ray's start, the deadline's margin
        m=$(( ($(left) - 75) / 4 - 93 - W32 )); [ "$m" -gt "$MCAP" ] && m=$MCAP; [ "$m" -lt 45 ] && m=45
        M32=$m; phase "c32 measuring cap ${m} s"
      fi
      study "c32$SUFFIX" 32 "$B32" "$m" "$W32" "${ENQ32:-$COVER}"; logtails "c32$SUFFIX" ;;
    c256) study "c256$SUFFIX" 256 "$B256" "$M256" "$W256" "${ENQ256:-$COVER}" ;;
    prune256)  # the pruner's saving: the case study's recipe (0.83x vLLM's defaults at 256
      # streams, experiments/h200-shapes) after the defaults, the pruner on (the default),
      # no re-check (the saving is the point, not the verdict); the study's trials.csv and
      # study.json give each trial's measuring seconds, the pruned one's against a full one
      if [ "$(left)" -le $(( 2 * (80 + W256) + M256 + 30 )) ]; then  # two warm starts
        phase "prune256 skipped: not enough device time left"
      else
        study "prune256$SUFFIX" 256 "$BPRUNE" "$M256" "$W256" "@experiments/h200/recipe.json" 0
        logtails "prune256$SUFFIX"
      fi ;;
    c256bench|c32bench)
      ph=${step%bench}; conc=${ph#c}; ph=$ph$SUFFIX; [ "$conc" = 32 ] && { m=${M32/auto/60}; w=$W32; } || { m=$M256; w=$W256; }
      # a bench starts when its start, warm-up and first repeat fit: stopped at its limit it
      # still reports the repeats it measured (and the whole segments of the last)
      need=$(( 100 + m + w + 40 ))
      if [ ! -f "$RES/$ph/configs.json" ] || [ "$(left)" -le "$need" ]; then
        phase "$ph re-measure skipped: no study or not enough device time left"
      elif [ "$NGPU" -ge 2 ]; then
        bench "$ph" candidate "$conc" "$m" "$w" & b1=$!; bench "$ph" defaults "$conc" "$m" "$w" & b2=$!; wait $b1 $b2  # not the nvidia-smi sampler
        logtails "$ph"
      else  # one GPU: one after the other (BENCH_ROLES picks, e.g. the one a lost machine left)
        declare -A seen=()
        for role in ${BENCH_ROLES:-candidate defaults}; do
          seen[$role]=$(( ${seen[$role]:-0} + 1 )); tag=$role; [ "${seen[$role]}" -gt 1 ] && tag=$role-${seen[$role]}
          if [ "$(left)" -gt "$need" ]; then bench "$ph" "$role" "$conc" "$m" "$w" "$tag"
          else phase "$ph re-measure of $tag skipped: not enough device time left"; fi
        done
        logtails "$ph"
      fi ;;
    preload)  # PRE_CONFIGS' defaults started plainly, then three times forked from a
      # preloaded interpreter (experiments/h200-trust/preload-starts.py; RES/preload/)
      mkdir -p "$RES/preload"
      timeout --kill-after=10 "$(within 480 20)" python3 experiments/h200-trust/preload-starts.py \
        "${PRE_CONFIGS:?PRE_CONFIGS: the configs.json to start}" "$CACHE" "$RES/preload" > "$RES/preload/run.log" 2>&1
      phase "preload exit $?"
      tar czf "$RES/preload/server-logs.tgz" -C "$RES/preload" logs 2>/dev/null && rm -rf "$RES/preload/logs" ;;
    startmethod)  # PRE_CONFIGS' candidate started twice, 32 streams: with vLLM's own `spawn`
      # for its engine process, then with the `fork` autotune's servers use; and vLLM's flag
      # surface read into the cache (its key: the wheel's RECORD), timed, then read back
      mkdir -p "$RES/start"; cp "${PRE_CONFIGS:?PRE_CONFIGS: the configs.json to start}" "$RES/start/configs.json"
      python3 - "$CACHE" > "$RES/start/surface.txt" 2>&1 <<'PY'
import sys, time
from pathlib import Path
from autotune.engine._flags import _cache_file, _locate, engine_surface
import os
version, build = _locate(sys.executable, os.environ)
print("build", version, build, _cache_file(Path(sys.argv[1]), sys.executable, build, version))
for i in (1, 2):
    t = time.monotonic(); engine_surface(cache_dir=Path(sys.argv[1]))
    print(f"surface {i}: {time.monotonic() - t:.1f} s")
PY
      phase "surface: $(tr '\n' ' ' < "$RES/start/surface.txt" | tail -c 200)"
      cp -r "$CACHE/vllm-surface" "$RES/start/" 2>/dev/null
      for m in spawn fork; do
        if [ "$(left)" -gt 150 ]; then bench start candidate 32 "${MSTART:-30}" "${WSTART:-20}" "$m" "VLLM_WORKER_MULTIPROC_METHOD=$m"
        else phase "start $m skipped: not enough device time left"; fi
      done
      logtails start ;;
    imports)  # what a server start spends importing (gVisor makes every stat a system call):
      # the API server's imports, twice (cold and warm), the 40 slowest by cumulative time
      if [ "$(left)" -gt 90 ]; then
        for i in 1 2; do
          t0=$(date +%s%N); timeout 60 python3 -X importtime -c 'import vllm.entrypoints.openai.api_server' 2> "$RUN/importtime-$i.txt" > /dev/null
          phase "imports $i: $(( ($(date +%s%N) - t0) / 1000000 )) ms"
        done
        sort -t'|' -k2 -n "$RUN/importtime-2.txt" | tail -40 > "$RES/importtime.txt"
      else phase "imports skipped: not enough device time left"; fi ;;
    caches)  # packed while the next step runs; the job waits for it before DONE (the
      # sixteenth session's job ended first and its poll brought back a truncated archive)
      ( phase "$(bash experiments/gpu-caches.sh pack "$CACHE" "$HOME/res-cache")" ) & PACK=$! ;;
  esac
done
cp "$RUN/autotune.db" "$RES/" 2>/dev/null
kill $SMI 2>/dev/null
[ -n "${PACK:-}" ] && wait "$PACK"  # the caches' parts complete before DONE
bash experiments/gpu-newfiles.sh "$HOME/.job-t0" "$RES/new-files.txt" "$HOME/res" "$HOME/run" \
    "$HOME/site" "$HOME/gpub" "$HOME/models" 2>/dev/null
phase done; touch "$RES/DONE"
