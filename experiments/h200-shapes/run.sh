#!/usr/bin/env bash
# Issue 15 on an nvidia-h200-x2 (or one nvidia-h200: GPUS=1, slower): a study per traffic
# shape, then the cross-evaluation of the studies' winners, vLLM's defaults and the case
# study's recipe on every shape, on fresh servers. One background job from the repo root:
#   setsid nohup bash experiments/h200-shapes/run.sh STAGING_DIR RES_DIR SECONDS_LEFT &
# SECONDS_LEFT: device seconds this session may still spend (status's budget_left_s less
# the polls that bring results back); no step starts when it cannot finish before then.
# STEPS (environment; default all): study:KEY (KEY in shapes.json: azure, mooncake,
# casestudy), recheck:KEY (once, a done study's verdict that kept the defaults only for want of
# starts: `tune --resume --recheck-starts K` with the K its starts_needed gives), more:KEY
# (once, a done study that measured only the defaults because its budget ended the search
# before its queued configs: `tune --resume`, which runs them, then the re-check) and
# cross:KEY. Consecutive cross steps share one queue of servers: one per
# config (flags and env), started fresh by cells.py, which measures on it each cell (one
# config on one shape, as `autotune bench` would: its own warm-up, objective, SLOs, caps) it
# still lacks, in turn; two servers at a time, one per GPU (CUDA_VISIBLE_DEVICES). A server
# is begun when its start and first cell fit before the deadline; cells.py leaves the cells
# after that which do not (a later session measures them). A study runs one trial per GPU
# (Ray, two slots).
# Resumable: a step whose results exist is skipped: in RES_DIR (this session), in
# RESUME_FROM (environment: a folder staged like the bundle holding a poll's res.tgz, or the
# res/ it unpacks to: results not committed yet) or in experiments/h200-shapes/results/ (the
# committed results, which travel with the repo tree). Stores: one Optuna SQLite and one
# MLflow SQLite for all sessions, seeded from RESUME_FROM or the committed ones, copied to
# RES_DIR/stores/ after each study (collect.sh commits them).
# Compile caches: parts named cache-part-* in STAGING_DIR (what poll.sh brought back from an
# earlier session) are unpacked first, so first starts are warm; after each step the caches
# are packed again in 15-MB parts under ~/res-cache for poll.sh to bring back.
# Knobs: STEPS, RESUME_FROM, BUDGET_<KEY> (a study's --budget, default shapes.json's
# budget_s, or budget_s_one_gpu on one GPU), TRIALS (default `steps.py study-args`: 4, defaults,
# cover_prefill, recipe, one TPE sample; a shape's one_gpu in shapes.json may ask for fewer
# and leave its re-check to the next session's recheck:KEY), DRY=1 (CPU dry
# run: autotune replaced by dryrun.py, nothing installed, no GPU).
set -uo pipefail
STAGE=${1:?staging dir}; RES=${2:?results dir}; LEFT=${3:?seconds of device time left}
T0=$(date +%s); DEADLINE=$(( T0 + LEFT ))
STEPS=${STEPS:-study:casestudy study:azure study:mooncake recheck:casestudy recheck:azure recheck:mooncake more:casestudy more:azure more:mooncake cross:casestudy cross:azure cross:mooncake}
DRY=${DRY:-0}; export TRIALS=${TRIALS:-}  # TRIALS: steps.py study-args' default when empty
# GPUS (environment): how many to use; default: what nvidia-smi lists (2 in a dry run). On
# one GPU (`nvidia-h200`) a study runs one trial at a time and the cross servers one by one.
GPUS=${GPUS:-$( [ "$DRY" = 1 ] && echo 2 || nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "$GPUS" -ge 1 ] 2>/dev/null || GPUS=1
SPACE=experiments/h200-trust/space-no-moe.yaml
H=experiments/h200-shapes; COMMITTED=${COMMITTED:-$PWD/$H/results}  # COMMITTED: for dry runs
mkdir -p "$RES"; RES=$(cd "$RES" && pwd); echo $$ > "$RES/pid"  # poll.sh waits only while this runs
SESSION=$RES/session-$(date -u +%Y%m%dT%H%M%S); mkdir -p "$SESSION"; export SESSION_NAME=${SESSION##*/}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1
left() { echo $(( DEADLINE - $(date +%s) )); }
phase() { echo "$(date -u +%H:%M:%S) left=$(left) $*" >> "$SESSION/progress.txt"; }
finish() { phase "${1:-done}"; touch "$RES/DONE"; exit "${2:-0}"; }
export GPUS
phase "start STEPS=$STEPS GPUS=$GPUS"
SITE=$HOME/site
if [ "$DRY" = 1 ]; then
  AT=(python3 "$H/dryrun.py"); CELLS=(python3 "$H/dryrun.py" cells); export PYTHONPATH=$PWD:${PYTHONPATH:-}
else
  AT=(python3 -m autotune); CELLS=(python3 "$H/cells.py")
  if [ ! -d "$SITE/vllm" ]; then
    ( time bash "$STAGE/install.sh" "$STAGE" "$SITE" ) > "$SESSION/env.txt" 2>&1 || finish install-failed 3
  fi
  export PYTHONPATH=$SITE:$PWD
  python3 - >> "$SESSION/env.txt" 2>&1 <<'PY'
import importlib.metadata as m, torch
for p in ("vllm", "torch", "optuna", "ray", "mlflow", "flashinfer-python", "transformers"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)
print("gpus", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >> "$SESSION/env.txt" 2>&1
  nvidia-smi topo -m >> "$SESSION/env.txt" 2>&1
  phase "$(bash experiments/gpu-bytecode.sh "$SITE")"  # once, where the image writes no .pyc
fi
git log -1 --format='code %H %s' >> "$SESSION/env.txt" 2>/dev/null
MODEL=$HOME/models/nemotron3-nano-30b-a3b-mtp
if [ ! -f "$MODEL/tokenizer.json" ]; then
  mkdir -p "$MODEL" && cp experiments/h200/model/config.json "$MODEL/"
  python3 -c "
from pathlib import Path; from autotune.modelgen import write_tokenizer
write_tokenizer(Path('$MODEL'), vocab_size=131072)" >> "$SESSION/env.txt" 2>&1 || finish model-failed 4
fi
phase installed
RUN=$HOME/run; CACHE=$HOME/.cache/autotune; mkdir -p "$RUN/logs" "$HOME/res-cache"

# results of earlier sessions: RESUME_FROM (staged, not committed yet), then the committed ones
DIRS=("$RES")
if [ -n "${RESUME_FROM:-}" ]; then
  R=$RESUME_FROM
  if [ -f "$R/res.tgz" ]; then mkdir -p "$HOME/resume" && tar xzf "$R/res.tgz" -C "$HOME/resume" && R=$HOME/resume/res; fi
  [ -d "$R" ] && DIRS+=("$R") && phase "resuming from $R: $(ls "$R" | tr '\n' ' ')"
fi
DIRS+=("$COMMITTED")
for db in autotune.db mlflow.db; do  # the stores every study of issue 15 goes to
  if [ ! -f "$RUN/$db" ]; then
    for d in "${DIRS[@]:1}"; do
      [ -f "$d/stores/$db" ] && { cp "$d/stores/$db" "$RUN/$db"; phase "store $db from $d"; break; }
    done
  fi
done
if ls "$STAGE"/cache-part-* >/dev/null 2>&1; then  # compile caches an earlier session brought back
  phase "$(bash experiments/gpu-caches.sh restore "$STAGE" "$CACHE" "$SITE")"
fi
SMI=
if [ "$DRY" != 1 ]; then
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used \
    --format=csv,nounits -l 1 > "$SESSION/gpu.csv" 2>/dev/null &
  SMI=$!
fi
PACK=
pack_caches() {  # in the background; the previous pack first
  [ -n "$PACK" ] && wait "$PACK" 2>/dev/null
  [ -d "$CACHE" ] || return
  ( rm -rf "$HOME/res-cache.new" \
    && msg=$(bash experiments/gpu-caches.sh pack "$CACHE" "$HOME/res-cache.new" 2>/dev/null) \
    && rm -rf "$HOME/res-cache" && mv "$HOME/res-cache.new" "$HOME/res-cache" && phase "$msg" ) &
  PACK=$!
}
S() { python3 "$H/steps.py" "$@"; }
stepjson() {  # DIR STEP START RC [EXTRA JSON]: the step's device-time account
  python3 - "$@" <<'PY'
import json, os, sys, time
d, step, t0, rc = sys.argv[1:5]
extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
t0 = int(t0); t1 = int(time.time())
rec = {"step": step, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
       "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t1)), "wall_s": t1 - t0,
       "gpus": int(os.environ.get("GPUS", "2")), "rc": int(rc),
       "session": os.environ.get("SESSION_NAME", ""), **extra}
open(f"{d}/step.json", "w").write(json.dumps(rec, indent=1) + "\n")
PY
}
logtails() {  # SRC_GLOB... -> OUT.tgz: head and tail of each server log
  local out=$1; shift; local d=$RUN/tails.$$; rm -rf "$d"; mkdir -p "$d"
  for f in "$@"; do [ -f "$f" ] && { head -c 20000 "$f"; echo; echo "[...]"; tail -c 30000 "$f"; } > "$d/$(basename "$f")"; done
  tar czf "$out" -C "$d" . 2>/dev/null; rm -rf "$d"
}

tune_study() {  # KEY CAP_S NAME TUNE_ARGS...: `autotune tune` of study KEY (its log
  # RES/study-KEY/NAME.log, server-log tails NAME-server-logs.tgz; exit status in TUNE_RC),
  # then its result files and both stores copied to RES
  local key=$1 cap=$2 log=$3 out=$RES/study-$1 targs; shift 3
  mapfile -t targs < <(S tune-args "$key"; S study-args "$key" "$GPUS")
  # the step's own arguments last: they win (a deferred re-check's --recheck 1)
  timeout --signal=TERM --kill-after=30 "$cap" "${AT[@]}" -v tune \
    --model "$MODEL" --space "$SPACE" "${targs[@]}" --no-quality-probe \
    --storage "sqlite:///$RUN/autotune.db" --tracking-uri "sqlite:///$RUN/mlflow.db" \
    --experiment h200-shapes --study-name "shapes-$key" --out "$RUN/study-$key" --cache-dir "$CACHE" \
    --start-timeout 480 --request-timeout 240 --seed 0 "$@" >> "$out/$log.log" 2>&1
  TUNE_RC=$?; echo "tune exit code $TUNE_RC" >> "$out/$log.log"
  for f in best.json study.json trials.csv config.yaml serve_command.sh; do
    [ -f "$RUN/study-$key/$f" ] && cp "$RUN/study-$key/$f" "$out/"; done
  for db in autotune.db mlflow.db; do [ -f "$RUN/$db" ] && S backup "$RUN/$db" "$RES/stores/$db"; done
  local tails=server-logs.tgz; [ "$log" = tune ] || tails=$log-server-logs.tgz
  logtails "$out/$tails" "$RUN/study-$key"/logs/*.log
}

study() {  # KEY
  local key=$1 name=shapes-$1 out=$RES/study-$1 have budget resume=() t0 rc
  if have=$(S done study "$key" "${DIRS[@]}"); then phase "study:$key done already ($have): skipped"; return; fi
  local bv="BUDGET_${key^^}" field=budget_s; [ "$GPUS" = 1 ] && field=budget_s_one_gpu
  budget=${!bv:-$(S get "$key" "$field")}; [ -n "$budget" ] || budget=$(S get "$key" budget_s)
  # the re-check may overrun the budget by about one trial (a trial in flight when the search
  # stopped); a study may overrun more, the timeout below then stops it for --resume
  local room=$(( $(left) - 60 - 330 ))
  [ "$budget" -gt "$room" ] && budget=$room
  if [ "$budget" -lt 420 ]; then phase "study:$key not started: $(left) s left, it needs ~800"; return; fi
  if S has-study "$RUN/autotune.db" "$name"; then resume=(--resume); fi
  mkdir -p "$out"; phase "study:$key budget ${budget}s ${resume[*]}"; t0=$(date +%s)
  # on one GPU the trial in flight when the search stops runs alone, then the re-check's
  # trials one after the other: allow more after the budget
  local over=500; [ "$GPUS" = 1 ] && over=700
  local cap=$(( $(left) - 40 )); [ "$cap" -gt $(( budget + over )) ] && cap=$(( budget + over ))
  tune_study "$key" "$cap" tune --budget "$budget" --recheck-starts 1 "${resume[@]}"; rc=$TUNE_RC
  stepjson "$out" "study:$key" "$t0" "$rc" "{\"budget_s\": $budget}"
  if [ "$rc" = 0 ]; then touch "$out/DONE"; phase "study:$key done$([ -f "$out/best.json" ] || echo ', no best.json: no feasible config')";
  else phase "study:$key ended with exit $rc, no DONE: a later session resumes it (--resume)"; fi
  pack_caches
}

recheck() {  # KEY: the fresh starts a done study's verdict asked for (its starts_needed), once
  local key=$1 out=$RES/study-$1 got k new need t0 rc
  if ! got=$(S recheck-starts "$key" "${DIRS[@]}"); then phase "recheck:$key: nothing to run: $got"; return; fi
  read -r k new <<< "$got"
  need=$(( 60 + new * ($(S start-seconds) + $(S cell-seconds "$key")) ))  # tune's start, each trial
  if [ "$(left)" -lt $(( need + 60 )) ]; then
    phase "recheck:$key not started: $(left) s left, $new fresh starts take ~$need"; return; fi
  mkdir -p "$out"; phase "recheck:$key --resume --recheck-starts $k ($new fresh starts, ~${need}s)"
  t0=$(date +%s)
  tune_study "$key" $(( $(left) - 40 )) recheck --budget 60 --recheck 1 --recheck-starts "$k" --resume; rc=$TUNE_RC
  resumed_end recheck "$key" "$t0" "$rc" RECHECKED "{\"recheck_starts\": $k, \"fresh_starts\": $new}"
}

resumed_end() {  # KIND KEY T0 RC MARKER EXTRA_JSON: the end of a step that resumed a done study
  local kind=$1 key=$2 t0=$3 rc=$4 marker=$5 extra=$6 out=$RES/study-$2
  mkdir -p "$RUN/$kind-$key"   # the study's own step.json stays as it is
  stepjson "$RUN/$kind-$key" "$kind:$key" "$t0" "$rc" "$extra"
  mv "$RUN/$kind-$key/step.json" "$out/$kind-step.json"
  if [ "$rc" = 0 ]; then touch "$out/DONE" "$out/$marker"; phase "$kind:$key done";
  else phase "$kind:$key ended with exit $rc (a later session may resume it)"; fi
  pack_caches
}

more() {  # KEY: a done study that measured only the defaults (its budget cut the search): resume it, once
  local key=$1 out=$RES/study-$1 why budget t0 rc over=500
  if ! why=$(S more "$key" "${DIRS[@]}"); then phase "more:$key: nothing to run: $why"; return; fi
  local bv="BUDGET_${key^^}" field=budget_s; [ "$GPUS" = 1 ] && { field=budget_s_one_gpu; over=700; }
  budget=${!bv:-$(S get "$key" "$field")}; [ -n "$budget" ] || budget=$(S get "$key" budget_s)
  local room=$(( $(left) - 60 - 330 )); [ "$budget" -gt "$room" ] && budget=$room
  if [ "$budget" -lt 420 ]; then phase "more:$key not started: $(left) s left, it needs ~800"; return; fi
  mkdir -p "$out"; phase "more:$key --resume, budget ${budget}s: $why"; t0=$(date +%s)
  local cap=$(( $(left) - 40 )); [ "$cap" -gt $(( budget + over )) ] && cap=$(( budget + over ))
  tune_study "$key" "$cap" more --budget "$budget" --recheck-starts 1 --resume; rc=$TUNE_RC
  resumed_end more "$key" "$t0" "$rc" SEARCHED_MORE "{\"budget_s\": $budget, \"resumed\": true}"
}

server() {  # GPU GROUP LABEL N LIMIT_S: one config's server, each of its N cells in turn, this GPU
  local gpu=$1 group=$2 label=$3 n=$4 secs=$5 t0 rc err=$SESSION/cross-server-$3.err
  t0=$(date +%s); phase "cross server $label on gpu$gpu: cells $n, limit ${secs}s"
  # cells.py prints one line per cell (begun, exit, not started): into progress.txt; its
  # stderr (warnings; a traceback if it breaks) goes with the session's files
  CUDA_VISIBLE_DEVICES=$gpu timeout --kill-after=30 "$secs" "${CELLS[@]}" "$group" --gpu "$gpu" \
    --log "$RUN/logs/cross-$label.log" --deadline "$DEADLINE" -- --model "$MODEL" \
    --cache-dir "$CACHE" --start-timeout 420 --seed 0 2>> "$err" \
    | while IFS= read -r l; do phase "$l"; done
  rc=${PIPESTATUS[0]}
  [ -s "$err" ] || rm -f "$err"
  phase "cross server $label on gpu$gpu exit $rc after $(( $(date +%s) - t0 )) s"
  # killed at its limit: the library's reaper stops that server within ~15 s; the next
  # server on this GPU must not start beside it
  if [ "$rc" -ge 124 ] && [ "$DRY" != 1 ]; then sleep 20; fi
}

worker() {  # GPU PLANFILE: take the next unclaimed server (config) whose first cell still fits
  local gpu=$1 plan=$2 i=0 group label n expect limit first
  while IFS=$'\t' read -r group label n expect limit first; do
    i=$((i + 1)); [ -n "$group" ] || continue
    mkdir "$RUN/claim.$i" 2>/dev/null || continue      # the other worker has it
    if [ "$(left)" -lt $(( first + 30 )) ]; then
      phase "cross server $label ($n cells) not started on gpu$gpu: $(left) s left, its start and first cell take ~$first"; continue
    fi
    [ "$limit" -gt $(( $(left) - 20 )) ] && limit=$(( $(left) - 20 ))
    server "$gpu" "$group" "$label" "$n" "$limit"   # cells.py leaves the cells that do not fit
  done < "$plan"
}

cross() {  # KEY...: every missing cell of these shapes, one server per config, two servers at a time
  local t0 plan=$RUN/plan.$$ w0 w1 k
  t0=$(date +%s); rm -rf "$RUN"/claim.* "$RUN/cells"
  S plan "$RES" "$RUN" "$@" -- "${DIRS[@]}" > "$plan" 2> "$RUN/plan.notes"
  while read -r l; do phase "$l"; done < "$RUN/plan.notes"
  phase "cross $*: $(awk -F'\t' '{n += $3} END {print n + 0}' "$plan") cells to measure on $(grep -c . "$plan") servers"
  if [ "$GPUS" -ge 2 ]; then
    worker 0 "$plan" & w0=$!; sleep 2; worker 1 "$plan" & w1=$!
    wait "$w0" "$w1"   # the two workers only, not the nvidia-smi sampler
  else
    worker 0 "$plan"   # one GPU: one server at a time
  fi
  for k in "$@"; do mkdir -p "$RES/cross-$k"; stepjson "$RES/cross-$k" "cross:$k" "$t0" 0 \
    "{\"shared_queue\": \"$*\"}"; done
  pack_caches
}

set -- $STEPS; QUEUE=()
flush() { [ ${#QUEUE[@]} -gt 0 ] && cross "${QUEUE[@]}"; QUEUE=(); }
for step in "$@"; do
  case $step in
    study:*) flush; study "${step#study:}" ;;
    recheck:*) flush; recheck "${step#recheck:}" ;;
    more:*) flush; more "${step#more:}" ;;
    cross:*) QUEUE+=("${step#cross:}") ;;
    *) phase "unknown step $step (study:KEY, recheck:KEY, more:KEY or cross:KEY)" ;;
  esac
done
flush
[ -n "$PACK" ] && wait "$PACK" 2>/dev/null
for db in autotune.db mlflow.db; do [ -f "$RUN/$db" ] && S backup "$RUN/$db" "$RES/stores/$db"; done
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
[ -f "$SESSION/gpu.csv" ] && gzip -f "$SESSION/gpu.csv"
finish done
