#!/usr/bin/env bash
# Issue 14's H200 proof, one background job on the offline GPU host, from the repo root:
#   setsid bash experiments/h200-trust/run.sh STAGING_DIR RES_DIR BUDGET_S &
# 1. a study (trial 0 = vLLM defaults, trial 1 = the case study's recipe) with segmented
#    warm-up, adaptive measurement (--precision 0.02), the pruner, a fresh-server re-check
#    and the verdict with its interval; 2. an independent re-measure on fresh servers
#    (autotune bench) of the re-checked candidate and of the defaults, to see whether the
#    re-measured ratio lies inside the interval the study stated.
# Quality probe off: it needs a reference server start (another ~60-300 s) and the proof is
# about throughput measurement; the recipe's FP16 Mamba state is lossy, so a user's study
# would probe it.
# Knobs (environment): CONC (closed-loop streams, default the shape's 256), NAME (study
# name), TRIALS (2), RECHECK_STARTS (1), MEASURE_MAX (120), WARMUP_MAX (120), PRUNER
# (interval; none measures every trial to the end, so a clear loser still gets its ratio),
# ENQUEUE (more configs to try first, JSON knob values separated by ';', e.g.
# '{"cudagraph_cover_prefill": true}').
# Compile caches: parts named cache-part-* in STAGING_DIR (a later session stages them like
# the bundle) are unpacked into ~/.cache/autotune first, so first starts are warm.
# Also: GPU clocks/power/utilisation every second (gpu.csv), and at the end the compile
# caches packed in 15 MB parts (~/res-cache) for a later session to carry back.
set -uo pipefail
STAGE=${1:?staging dir}; RES=${2:?results dir}; BUDGET=${3:-1100}
CONC=${CONC:-}; NAME=${NAME:-h200-trust}; TRIALS=${TRIALS:-2}; RECHECK_STARTS=${RECHECK_STARTS:-1}
MEASURE_MAX=${MEASURE_MAX:-120}; WARMUP_MAX=${WARMUP_MAX:-120}; PRUNER=${PRUNER:-interval}
CONC_ARG=(); [ -n "$CONC" ] && CONC_ARG=(--concurrency "$CONC")
ENQ_ARG=(); IFS=';' read -ra _enq <<< "${ENQUEUE:-}"; for e in "${_enq[@]}"; do [ -n "$e" ] && ENQ_ARG+=(--enqueue "$e"); done
mkdir -p "$RES"; echo $$ > "$RES/pid"  # poll.sh waits only while this runs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_DEDUP_LOGS=0 PYTHONUNBUFFERED=1
SITE=$HOME/site
phase() { echo "$(date -u +%H:%M:%S) $*" >> "$RES/progress.txt"; }
phase start
if [ ! -d "$SITE/vllm" ]; then
  ( time bash "$STAGE/install.sh" "$STAGE" "$SITE" ) > "$RES/env.txt" 2>&1 || { phase install-failed; touch "$RES/DONE"; exit 3; }
fi
export PYTHONPATH=$SITE:$PWD
python3 - >> "$RES/env.txt" 2>&1 <<'PY'
import importlib.metadata as m, torch
for p in ("vllm", "torch", "optuna", "ray", "mlflow", "flashinfer-python", "transformers"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)
print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv >> "$RES/env.txt" 2>&1
phase installed
MODEL=$HOME/models/nemotron3-nano-30b-a3b-mtp
if [ ! -f "$MODEL/tokenizer.json" ]; then
  mkdir -p "$MODEL" && cp experiments/h200/model/config.json "$MODEL/"
  python3 -c "
from pathlib import Path; from autotune.modelgen import write_tokenizer
write_tokenizer(Path('$MODEL'), vocab_size=131072)" >> "$RES/env.txt" 2>&1 || { phase model-failed; touch "$RES/DONE"; exit 4; }
fi
RUN=$HOME/run; mkdir -p "$RUN" "$HOME/res-cache"
CACHE=$HOME/.cache/autotune
if ls "$STAGE"/cache-part-* >/dev/null 2>&1; then  # compile caches an earlier session brought back
  mkdir -p "$CACHE" && cat "$STAGE"/cache-part-* | tar xzf - -C "$CACHE" && phase "caches restored: $(du -sh "$CACHE" | cut -f1)"
fi
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used \
  --format=csv,nounits -l 1 > "$RES/gpu.csv" 2>/dev/null &
SMI=$!
phase tune
args=(--model "$MODEL" --shape traffic/casestudy-512x512.json --space search_spaces/hybrid-mtp.yaml
      --trials "$TRIALS" --budget "$BUDGET" --enqueue @experiments/h200/recipe.json "${ENQ_ARG[@]}" "${CONC_ARG[@]}"
      --recheck 1 --recheck-starts "$RECHECK_STARTS" --precision 0.02 --pruner "$PRUNER"
      --measure-max-s "$MEASURE_MAX" --warmup-max-s "$WARMUP_MAX"
      --no-quality-probe --storage "sqlite:///$RUN/autotune.db" --tracking-uri "sqlite:///$RUN/mlflow.db"
      --study-name "$NAME" --out "$RUN/study" --cache-dir "$CACHE"
      --start-timeout 420 --request-timeout 240 --seed 0)
timeout --signal=TERM --kill-after=20 $((BUDGET + 200)) python3 -m autotune -v tune "${args[@]}" > "$RES/tune.log" 2>&1
echo "tune exit code $?" >> "$RES/tune.log"
cp "$RUN"/study/best.json "$RUN"/study/trials.csv "$RUN"/study/study.json "$RUN/autotune.db" "$RES"/ 2>/dev/null
phase bench
( nice tar czf - -C "$CACHE" --exclude=quality . | split -b 15M - "$HOME/res-cache/cache-part-" \
  && phase "caches: $(du -sh "$CACHE"/* 2>/dev/null | tr '\n' ' ') in $(ls "$HOME/res-cache" | wc -l) parts" ) &
# the flags of the re-checked candidate and of the defaults trial, as the study ran them
python3 - "$RUN/autotune.db" "$NAME" > "$RES/verdict-configs.json" 2>>"$RES/env.txt" <<'PY'
import json, sys, optuna
s = optuna.load_study(study_name=sys.argv[2], storage=f"sqlite:///{sys.argv[1]}")
v = s.user_attrs.get("autotune.verdict") or {}
out = {}
for role, key in (("defaults", "baseline_number"), ("candidate", "candidate_number")):
    n = v.get(key)
    if n is not None:
        t = s.trials[n]
        out[role] = {"number": n, "flags": t.user_attrs.get("autotune.flags", []),
                     "env": t.user_attrs.get("autotune.env", {})}
print(json.dumps(out))
PY
bench() {  # ROLE: fresh server, segmented warm-up, adaptive measurement
  local role=$1 flags=() envs=()
  mapfile -t flags < <(python3 -c "import json;d=json.load(open('$RES/verdict-configs.json')).get('$role');[print(f) for f in (d or {}).get('flags', [])]")
  while IFS= read -r kv; do envs+=(--env "$kv"); done < <(python3 -c "import json;d=json.load(open('$RES/verdict-configs.json')).get('$role');[print(f'{k}={v}') for k,v in (d or {}).get('env', {}).items()]")
  [ ${#flags[@]} -gt 0 ] || { phase "bench $role: no config"; return; }
  timeout 600 python3 -m autotune bench --model "$MODEL" --shape traffic/casestudy-512x512.json \
    "${CONC_ARG[@]}" --cache-dir "$CACHE" --precision 0.02 --measure-max-s "$MEASURE_MAX" \
    --warmup-max-s "$WARMUP_MAX" --start-timeout 420 \
    --log "$RUN/bench-$role.log" --json "${envs[@]}" -- "${flags[@]}" > "$RES/bench-$role.json" 2> "$RES/bench-$role.err"
  phase "bench $role exit $?"
}
bench candidate
bench defaults
mkdir -p "$RUN/logtails" && for f in "$RUN"/study/logs/*.log "$RUN"/bench-*.log; do
  [ -f "$f" ] && { head -c 20000 "$f"; echo; echo "[...]"; tail -c 40000 "$f"; } > "$RUN/logtails/$(basename "$f")"; done
tar czf "$RES/server-logs.tgz" -C "$RUN" logtails 2>/dev/null
kill $SMI 2>/dev/null
wait
phase done; touch "$RES/DONE"
