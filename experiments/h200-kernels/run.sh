#!/usr/bin/env bash
# Issue 16's H200 proof, one background job on the offline GPU host, from the repo root:
#   setsid nohup bash experiments/h200-kernels/run.sh STAGING_DIR RES_DIR [BUDGET_S] [GPUS] &
#   bash experiments/h200-kernels/poll.sh 540        # repeated; brings back RES_DIR
# (a) `autotune kernels moe` for the 30B stand-in at 256 and at 32 streams, MTP depth 0 and 1
#     (45 % of BUDGET_S, split 5:4 over the two calls; one folder: the second call keeps the
#     token counts the first already tuned);
# (b) kernel-level before/after per token count through vLLM's own lookup (compare.py);
# (c) one decode step profiled (profile_step.py) at 32 streams: vLLM defaults, MTP 1 at
#     acceptance 1.70, then both with the tuned folder, each only if >= 420 s are left;
# (d) `e2e` (not in the default STEPS): the end-to-end table, `autotune bench` of a config
#     with vLLM's default tiles and with the tuned folder, E2E_ROUNDS (default 2) fresh
#     starts each in alternating order, every cell's first start before any second (e2e.py
#     plan), at E2E_STREAMS (default "32") for E2E_BASES (default
#     "defaults"; "recipe" = experiments/h200/recipe.json), measure/warm-up caps E2E_MEASURE
#     (75 s) / E2E_WARMUP (30 s below 128 streams, 60 s from 128), each bench only if it fits
#     what is left; the tuned folder is (a)'s of this session, else E2E_TUNED (e.g. the
#     committed experiments/h200-kernels/results). Then e2e.md/e2e.csv (e2e.py table).
# STEPS (environment): default "kernels compare profile"; e.g. STEPS=e2e in a later session;
#   `caches` (last) packs the compile caches into ~/res-cache/cache-part-* for the next
#   session (poll.sh PART... brings them back; experiments/gpu-caches.sh says why and how).
# E2E_SEED (environment): a folder of benches an earlier session brought back (its e2e/*.json,
#   e.g. experiments/h200-kernels/results-e2e): copied into RES/e2e first, so not run again.
# ROUTING (environment): the profiles' MoE routing, VLLM_MOE_ROUTING_SIMULATION_STRATEGY
# (default uniform_random; ROUTING= for the dummy weights' own, every token to the same
# experts, as the first profiles of 2026-12-01 ran); the profile names end in -<routing>.
# PROFILES (environment): which of "defaults mtp1 defaults-tuned mtp1-tuned" to profile
# (default all four, each while >= 420 s are left).
# KSEED (environment): a folder an earlier session's kernels step wrote (e.g. the committed
# experiments/h200-kernels/results): its token counts are reused, not timed again, and the
# file is rewritten by this code's rules (guard keys, --min-gain); new counts are tuned.
# KSHARE (environment): the kernels' share of BUDGET_S in percent (default 45; e.g. 30 to
# leave the profiles room for two cold engine starts).
# Compile caches: parts named cache-part-* in STAGING_DIR (an earlier session's, as
# experiments/h200-trust/proof-x2.sh packs them) are unpacked into the shared cache first.
# Results (RES_DIR): progress.txt, env.txt, E=128,N=1856,device_name=NVIDIA_H200.json,
# kernels.results.json, kernel-compare.csv, profile.json, e2e/ + e2e.md + e2e.csv,
# logs.tgz (logs, every candidate).
set -uo pipefail
STAGE=${1:?staging dir}; RES=${2:?results dir}; BUDGET=${3:-1300}; GPUS=${4:-1}
STEPS=${STEPS:-kernels compare profile}
mkdir -p "$RES"; echo $$ > "$RES/pid"  # poll.sh waits only while this runs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
SITE=$HOME/site
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
phase() { echo "$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> "$RES/progress.txt"; }
finish() {
  local logs=$HOME/run/logs; rm -rf "$logs"; mkdir -p "$logs"  # this job's only (a warm machine keeps the last's)
  cp "$RES"/*.log "$logs"/ 2>/dev/null; cp -r "$TUNED" "$logs"/tuned 2>/dev/null
  tar czf "$RES/logs.tgz" -C "$HOME/run" logs 2>/dev/null && rm -f "$RES"/*.log
  bash experiments/gpu-newfiles.sh "$HOME/.job-t0" "$RES/new-files.txt" "$HOME/res" "$HOME/run" \
    "$HOME/site" "$HOME/gpub" "$HOME/models" 2>/dev/null
  phase "done $1"; touch "$RES/DONE"; exit "${2:-0}"
}
phase start
touch "$HOME/.job-t0"  # what this job writes outside its folders: new-files.txt at the end
if [ ! -d "$SITE/vllm" ]; then
  ( time bash "$STAGE/install.sh" "$STAGE" "$SITE" ) > "$RES/env.txt" 2>&1 || { phase install-failed; touch "$RES/DONE"; exit 3; }
fi
export PYTHONPATH=$SITE:$PWD
python3 - >> "$RES/env.txt" 2>&1 <<'PY'
import importlib.metadata as m, torch
for p in ("vllm", "torch", "triton", "optuna", "flashinfer-python", "transformers"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)
print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv >> "$RES/env.txt" 2>&1
phase installed
# shared compile/JIT caches, as autotune's servers use them (--cache-dir: autotune.engine.cache_env)
C=$HOME/.cache/autotune
eval "$(python3 -c 'import shlex, sys; from pathlib import Path; from autotune.engine import cache_env
for k, v in cache_env(Path(sys.argv[1])).items(): print(f"export {k}={shlex.quote(v)}")' "$C")"
MODEL=$HOME/models/nemotron3-nano-30b-a3b-mtp
if [ ! -f "$MODEL/tokenizer.json" ]; then
  mkdir -p "$MODEL" && cp experiments/h200/model/config.json "$MODEL/"
  python3 -c "
from pathlib import Path; from autotune.modelgen import write_tokenizer
write_tokenizer(Path('$MODEL'), vocab_size=131072)" >> "$RES/env.txt" 2>&1 || { phase model-failed; touch "$RES/DONE"; exit 4; }
fi
RUN=$HOME/run; TUNED=$RUN/kernels-tuned; mkdir -p "$RUN"
SHAPE=traffic/casestudy-512x512.json
KB=$(( BUDGET * ${KSHARE:-45} / 100 ))
if ls "$STAGE"/cache-part-* >/dev/null 2>&1; then  # compile caches an earlier session brought back
  phase "$(bash experiments/gpu-caches.sh restore "$STAGE" "$C" "$SITE")"
fi
kernels() {
  if [ -n "${KSEED:-}" ] && ! ls "$TUNED"/E=*.results.json >/dev/null 2>&1; then
    mkdir -p "$TUNED"  # an earlier session's tuning: reused (nothing timed again), rewritten
    for f in "$KSEED"/E=*NVIDIA_H200.json; do               # by this code's rules
      cp "$f" "$TUNED/" && cp "$KSEED/kernels.results.json" "$TUNED/$(basename "$f" .json).results.json"
    done
    phase "kernels seeded from $KSEED"
  fi
  for spec in "256 $(( KB * 5 / 9 ))" "32 $(( KB * 4 / 9 ))"; do
    set -- $spec
    phase "kernels $1 streams, budget $2 s"
    timeout --signal=TERM --kill-after=20 $(( $2 + 300 )) python3 -m autotune -v kernels moe \
      --model "$MODEL" --shape "$SHAPE" --concurrency "$1" --mtp-depth 0,1 --gpus "$GPUS" \
      --trials 32 --budget "$2" --out "$TUNED" >> "$RES/kernels.log" 2>&1
    phase "kernels $1 exit $?"
  done
  cp "$TUNED"/E=*NVIDIA_H200.json "$RES"/ 2>/dev/null
  cp "$TUNED"/E=*.results.json "$RES/kernels.results.json" 2>/dev/null
  [ -f "$RES/kernels.results.json" ] || finish kernels-failed 5
}
compare() {
  phase compare
  timeout 360 python3 experiments/h200-kernels/compare.py --model "$MODEL" --tuned "$TUNED" \
    --out "$RES/kernel-compare.csv" >> "$RES/compare.log" 2>&1
  phase "compare exit $?"
}
ROUTING=${ROUTING-uniform_random}; PSUF=$([ -n "$ROUTING" ] && echo "-$ROUTING" || echo "-dummy")
profile() {
  for spec in "defaults 0 -" "mtp1 1 -" "defaults-tuned 0 $TUNED" "mtp1-tuned 1 $TUNED"; do
    set -- $spec
    case " ${PROFILES:-defaults mtp1 defaults-tuned mtp1-tuned} " in *" $1 "*) ;; *) continue ;; esac
    if [ "$(left)" -lt 420 ]; then phase "profile $1 skipped: $(left) s left"; continue; fi
    tuned=(); [ "$3" != "-" ] && tuned=(--tuned "$3")
    phase "profile $1"
    timeout --signal=TERM --kill-after=20 $(( $(left) - 20 )) python3 experiments/h200-kernels/profile_step.py \
      --model "$MODEL" --name "$1$PSUF" --streams 32 --mtp "$2" --acceptance 1.7 "${tuned[@]}" \
      --routing "$ROUTING" \
      --out "$RES/profile.json" >> "$RES/profile.log" 2>&1
    phase "profile $1 exit $?"
  done
}
e2e() {
  local folder=$TUNED streams base variant round m w args envs flags out limit
  ls "$folder"/E=*NVIDIA_H200.json >/dev/null 2>&1 || folder=${E2E_TUNED:-}
  if [ -z "$folder" ] || ! ls "$folder"/E=*NVIDIA_H200.json >/dev/null 2>&1; then
    phase "e2e skipped: no tuned folder (run the kernels step first, or set E2E_TUNED)"; return
  fi
  folder=$(cd "$folder" && pwd); mkdir -p "$RES/e2e"; phase "e2e: tuned folder $folder"
  if [ -n "${E2E_SEED:-}" ] && ls "$E2E_SEED"/e2e/c*.json >/dev/null 2>&1; then
    cp -n "$E2E_SEED"/e2e/c*.json "$RES/e2e/" && phase "e2e: $(ls "$E2E_SEED"/e2e/c*.json | wc -l) benches from $E2E_SEED"
  fi
  while read -r streams base variant round; do
    out=$RES/e2e/c$streams-$base-$variant-r$round.json
    [ -s "$out" ] && { phase "e2e $streams $base $variant r$round: done already"; continue; }
    m=${E2E_MEASURE:-75}; w=${E2E_WARMUP:-$([ "$streams" -ge 128 ] && echo 60 || echo 30)}
    if [ "$(left)" -lt $(( 150 + m + w )) ]; then
      phase "e2e $streams $base $variant r$round skipped: $(left) s left"; continue; fi
    mapfile -t args < <(python3 experiments/h200-kernels/e2e.py args "$base" "$streams")
    envs=(); [ "$variant" = tuned ] && envs=(--env "VLLM_TUNED_CONFIG_FOLDER=$folder")
    limit=$(( $(left) - 20 )); [ "$limit" -gt $(( 480 + m + w )) ] && limit=$(( 480 + m + w ))
    phase "e2e $streams $base $variant r$round"
    timeout --kill-after=15 "$limit" python3 -m autotune bench --model "$MODEL" --shape "$SHAPE" \
      --concurrency "$streams" --cache-dir "$C" --precision 0.02 --measure-max-s "$m" \
      --warmup-max-s "$w" --start-timeout 420 --json --log "$RES/e2e-c$streams-$base-$variant-r$round.log" \
      "${envs[@]}" "${args[@]}" > "$out.part" 2>> "$RES/e2e.log" < /dev/null
    local rc=$?; [ -s "$out.part" ] && mv "$out.part" "$out"
    phase "e2e $streams $base $variant r$round exit $rc"
  done < <(python3 experiments/h200-kernels/e2e.py plan --rounds "${E2E_ROUNDS:-2}" ${E2E_STREAMS:-32} -- ${E2E_BASES:-defaults})
  python3 experiments/h200-kernels/e2e.py table "$RES" >> "$RES/progress.txt" 2>&1
}
caches() {  # for the next session: poll.sh brings the parts back (see the README)
  phase "$(bash experiments/gpu-caches.sh pack "$C" "$HOME/res-cache")"
}
for step in $STEPS; do
  case $step in
    kernels|compare|profile|e2e|caches) "$step" ;;
    *) phase "unknown step $step (kernels, compare, profile, e2e, caches)" ;;
  esac
done
finish ok
