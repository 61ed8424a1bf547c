#!/usr/bin/env bash
# The H200 proof (issue 5), one command on the offline GPU host, from the repo root:
#   bash experiments/h200/run.sh STAGING_DIR OUT_DIR BUDGET_S [--resume]
# STAGING_DIR holds the wheel parts made by scripts/gpu/make_bundle.py (installed once);
# OUT_DIR receives the results; BUDGET_S: no new trial starts after this many seconds.
# The study: Nemotron-3-Nano-30B-A3B shape + 1 MTP layer, random weights, the case study's
# traffic (512 in / 512 out, 256 closed-loop streams); trial 0 = vLLM defaults, trial 1 = the
# case study's five-step recipe (recipe.json), then TPE over search_spaces/hybrid-mtp.yaml.
# One trial per GPU (Ray); all trials share vLLM's compile and FlashInfer's JIT caches.
set -uo pipefail
STAGE=${1:?staging dir}; OUT=${2:?out dir}; BUDGET=${3:-300}; MODE=${4:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 RAY_DEDUP_LOGS=0
SITE=$HOME/site
if [ ! -d "$SITE/vllm" ]; then
  ( time bash "$STAGE/install.sh" "$STAGE" "$SITE" ) > "$OUT/env.txt" 2>&1 || { tail -20 "$OUT/env.txt"; exit 3; }
fi
export PYTHONPATH=$SITE:$PWD
python3 - >> "$OUT/env.txt" 2>&1 <<'PY'
import importlib.metadata as m, torch
for p in ("vllm", "torch", "optuna", "ray", "mlflow", "flashinfer-python", "transformers"):
    try: print(p, m.version(p))
    except Exception as e: print(p, "missing", e)
print("gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv >> "$OUT/env.txt" 2>&1
nproc >> "$OUT/env.txt"; cat "$OUT/env.txt"

MODEL=$HOME/models/nemotron3-nano-30b-a3b-mtp
if [ ! -f "$MODEL/tokenizer.json" ]; then
  mkdir -p "$MODEL" && cp experiments/h200/model/config.json "$MODEL/"
  python3 -c "
from pathlib import Path; from autotune.modelgen import write_tokenizer
write_tokenizer(Path('$MODEL'), vocab_size=131072)" || exit 4
fi
RUN=$HOME/run
mkdir -p "$RUN"
args=(--model "$MODEL" --shape traffic/casestudy-512x512.json --space search_spaces/hybrid-mtp.yaml
      --trials 60 --timeout "$BUDGET" --num-requests 768 --warmup-requests 256
      --storage "sqlite:///$RUN/autotune.db" --tracking-uri "sqlite:///$RUN/mlflow.db"
      --study-name h200-casestudy --out "$RUN/study" --cache-dir "$HOME/.cache/autotune"
      --start-timeout 330 --request-timeout 240 --seed 0)
if [ "$MODE" = "--resume" ]; then args+=(--resume); else args+=(--enqueue @experiments/h200/recipe.json); fi
timeout --signal=TERM --kill-after=20 $((BUDGET + 250)) python3 -m autotune -v tune "${args[@]}" > "$OUT/tune.log" 2>&1
echo "tune exit code $?" | tee -a "$OUT/tune.log"
tail -25 "$OUT/tune.log"
cp "$RUN"/study/best.json "$RUN"/study/trials.csv "$RUN"/study/study.json "$OUT"/ 2>/dev/null
cp "$RUN/autotune.db" "$OUT/" 2>/dev/null
# server logs: the head (flags, config) and tail (errors) of each, in one archive
mkdir -p "$RUN/logtails" && for f in "$RUN"/study/logs/*.log; do
  { head -c 20000 "$f"; echo; echo "[...]"; tail -c 60000 "$f"; } > "$RUN/logtails/$(basename "$f")"; done
tar czf "$OUT/server-logs.tgz" -C "$RUN" logtails 2>/dev/null
ls -la "$OUT"
