#!/usr/bin/env bash
# FP8 weights (vLLM's online --quantization fp8 of a BF16 checkpoint) against vLLM's defaults
# at 256 closed-loop streams of the case-study shape (512 in / 512 out), on one GPU.
#
# From the repository root, on the GPU host (vLLM 0.26 and autotune's dependencies
# importable, e.g. PYTHONPATH=SITE:$PWD):
#   bash experiments/h200-fp8/run.sh RESULTS_DIR [SECONDS]
# SECONDS caps the whole run (default 1500); MODEL names a model folder (default: the 30B
# hybrid + MTP stand-in, experiments/h200/model/config.json with a generated tokenizer and
# random weights). SPACE, ENQUEUE and STUDY override the space, the enqueued config and the
# study's name (defaults: the H200 run below; run-80gb.sh sets them for an 80-GB card). The run writes RESULTS_DIR/pid first and RESULTS_DIR/DONE last, and
# RESULTS_DIR/progress.txt as it goes.
#
# 1. The study: trial 0 = vLLM's defaults, trial 1 = quantization=fp8 (enqueued), each
#    re-checked on one fresh server (--recheck 1 --recheck-starts 1), no pruner (every
#    config measured to its stop), the quality probe off (random weights: nothing to judge),
#    ended by its verdict (the rule: README.md, "Verdict rule").
# 2. When the time left allows it: an independent re-measure of the verdict's config and of
#    the defaults on fresh servers (autotune bench, one repeat each).
set -uo pipefail
RES=${1:?usage: run.sh RESULTS_DIR [SECONDS]}; LEFT=${2:-1500}
T0=$(date +%s)
mkdir -p "$RES"; echo $$ > "$RES/pid"
left() { echo $(( LEFT - ($(date +%s) - T0) )); }
phase() { echo "$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> "$RES/progress.txt"; }
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
phase start
python3 - > "$RES/env.txt" 2>&1 <<'PY'
import importlib.metadata as m, torch
for p in ("vllm", "torch", "optuna", "ray", "mlflow", "flashinfer-python", "transformers"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)
print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv >> "$RES/env.txt" 2>&1
MODEL=${MODEL:-$HOME/models/nemotron3-nano-30b-a3b-mtp}
if [ ! -f "$MODEL/tokenizer.json" ]; then  # the stand-in: config.json and a tokenizer
  mkdir -p "$MODEL" && cp experiments/h200/model/config.json "$MODEL/"
  python3 -c "
from pathlib import Path; from autotune.engine import write_tokenizer
write_tokenizer(Path('$MODEL'), vocab_size=131072)" >> "$RES/env.txt" 2>&1 \
    || { phase model-failed; touch "$RES/DONE"; exit 4; }
fi
RUN=${RUN:-$HOME/run-h200-fp8}; CACHE=${CACHE:-$HOME/.cache/autotune}; mkdir -p "$RUN"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,memory.used \
  --format=csv,nounits -l 1 > "$RES/gpu.csv" 2>/dev/null &
SMI=$!
# No search budget: the two configs and their re-checks are the study; SECONDS caps the
# whole run (a study stopped by the cap keeps every finished trial in autotune.db).
phase tune
SPACE=${SPACE:-search_spaces/hybrid-mtp.yaml}; ENQUEUE=${ENQUEUE:-'{"quantization": "fp8"}'}
STUDY=${STUDY:-h200-fp8}
args=(--model "$MODEL" --shape traffic/casestudy-512x512.json --space "$SPACE"
      --trials 2 --enqueue "$ENQUEUE" --recheck 1 --recheck-starts 1
      --pruner none --precision 0.02 --measure-max-s 45 --warmup-max-s 60 --no-quality-probe
      --storage "sqlite:///$RUN/autotune.db" --tracking-uri "sqlite:///$RUN/mlflow.db"
      --study-name "$STUDY" --out "$RUN/study" --cache-dir "$CACHE"
      --start-timeout 480 --request-timeout 240 --seed 0)
timeout --signal=TERM --kill-after=20 $(( $(left) - 30 )) \
  python3 -m autotune -v tune "${args[@]}" > "$RES/tune.log" 2>&1
echo "tune exit code $?" >> "$RES/tune.log"
cp "$RUN"/study/best.json "$RUN"/study/trials.csv "$RUN"/study/study.json "$RUN/autotune.db" \
  "$RES"/ 2>/dev/null
phase "tune done"
# the flags and environment of the verdict's candidate and of the defaults, as the study ran them
python3 - "$RUN/autotune.db" "$STUDY" > "$RES/verdict-configs.json" 2>>"$RES/env.txt" <<'PY'
import json, sys, optuna
s = optuna.load_study(study_name=sys.argv[2], storage=f"sqlite:///{sys.argv[1]}")
v = s.user_attrs.get("autotune.verdict") or {}
out = {}
for role, key in (("candidate", "candidate_number"), ("defaults", "baseline_number")):
    n = v.get(key)
    if n is not None:
        t = s.trials[n]
        out[role] = {"number": n, "flags": t.user_attrs.get("autotune.flags", []),
                     "env": t.user_attrs.get("autotune.env", {})}
print(json.dumps(out))
PY
bench() {  # ROLE: a fresh server, the same warm-up and stop rule as the study, one repeat
  local role=$1 flags=() envs=()
  mapfile -t flags < <(python3 -c "import json;d=json.load(open('$RES/verdict-configs.json')).get('$role');[print(f) for f in (d or {}).get('flags', [])]")
  while IFS= read -r kv; do envs+=(--env "$kv"); done < <(python3 -c "import json;d=json.load(open('$RES/verdict-configs.json')).get('$role');[print(f'{k}={v}') for k,v in (d or {}).get('env', {}).items()]")
  [ ${#flags[@]} -gt 0 ] || { phase "bench $role: no config"; return; }
  if [ "$(left)" -lt 260 ]; then phase "bench $role: not run ($(left)s left)"; return; fi
  timeout $(( $(left) - 20 )) python3 -m autotune bench --model "$MODEL" \
    --shape traffic/casestudy-512x512.json --cache-dir "$CACHE" --precision 0.02 \
    --measure-max-s 45 --warmup-max-s 60 --start-timeout 300 \
    --log "$RUN/bench-$role.log" --json "${envs[@]}" -- "${flags[@]}" \
    > "$RES/bench-$role.json" 2> "$RES/bench-$role.err"
  phase "bench $role exit $?"
}
bench candidate
bench defaults
for f in "$RUN"/study/logs/*.log "$RUN"/bench-*.log; do  # the servers' logs, head and tail
  [ -f "$f" ] && { head -c 20000 "$f"; echo "[...]"; tail -c 30000 "$f"; } > "$RES/log-$(basename "$f")"
done
kill $SMI 2>/dev/null; gzip -f "$RES/gpu.csv"
phase done; touch "$RES/DONE"
