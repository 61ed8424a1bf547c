#!/usr/bin/env bash
# Issue 16's H200 proof, one background job on the offline GPU host, from the repo root:
#   setsid nohup bash experiments/h200-kernels/run.sh STAGING_DIR RES_DIR [BUDGET_S] [GPUS] &
#   bash experiments/h200-kernels/poll.sh 540        # repeated; brings back RES_DIR
# (a) `autotune kernels moe` for the 30B stand-in at 256 and at 32 streams, MTP depth 0 and 1
#     (45 % of BUDGET_S, split 5:4 over the two calls; one folder: the second call keeps the
#     token counts the first already tuned);
# (b) kernel-level before/after per token count through vLLM's own lookup (compare.py);
# (c) one decode step profiled (profile_step.py) at 32 streams: vLLM defaults, MTP 1 at
#     acceptance 1.70, then both with the tuned folder, each only if >= 420 s are left.
# Results (RES_DIR): progress.txt, env.txt, E=128,N=1856,device_name=NVIDIA_H200.json,
# kernels.results.json, kernel-compare.csv, profile.json, logs.tgz (logs, every candidate).
set -uo pipefail
STAGE=${1:?staging dir}; RES=${2:?results dir}; BUDGET=${3:-1300}; GPUS=${4:-1}
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
SITE=$HOME/site
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
phase() { echo "$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*" >> "$RES/progress.txt"; }
finish() {
  local logs=$HOME/run/logs; mkdir -p "$logs"
  cp "$RES"/*.log "$logs"/ 2>/dev/null; cp -r "$TUNED" "$logs"/tuned 2>/dev/null
  tar czf "$RES/logs.tgz" -C "$HOME/run" logs 2>/dev/null && rm -f "$RES"/*.log
  phase "done $1"; touch "$RES/DONE"; exit "${2:-0}"
}
phase start
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
# shared compile/JIT caches, as autotune's servers use them (--cache-dir)
C=$HOME/.cache/autotune
export VLLM_CACHE_ROOT=$C/vllm FLASHINFER_WORKSPACE_BASE=$C/flashinfer TRITON_CACHE_DIR=$C/triton TORCHINDUCTOR_CACHE_DIR=$C/inductor
MODEL=$HOME/models/nemotron3-nano-30b-a3b-mtp
if [ ! -f "$MODEL/tokenizer.json" ]; then
  mkdir -p "$MODEL" && cp experiments/h200/model/config.json "$MODEL/"
  python3 -c "
from pathlib import Path; from autotune.modelgen import write_tokenizer
write_tokenizer(Path('$MODEL'), vocab_size=131072)" >> "$RES/env.txt" 2>&1 || { phase model-failed; touch "$RES/DONE"; exit 4; }
fi
RUN=$HOME/run; TUNED=$RUN/kernels-tuned; mkdir -p "$RUN"
SHAPE=traffic/casestudy-512x512.json
KB=$(( BUDGET * 45 / 100 ))
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
phase compare
timeout 600 python3 experiments/h200-kernels/compare.py --model "$MODEL" --tuned "$TUNED" \
  --out "$RES/kernel-compare.csv" >> "$RES/compare.log" 2>&1
phase "compare exit $?"
for spec in "defaults 0 -" "mtp1 1 -" "defaults-tuned 0 $TUNED" "mtp1-tuned 1 $TUNED"; do
  set -- $spec
  if [ "$(left)" -lt 420 ]; then phase "profile $1 skipped: $(left) s left"; continue; fi
  tuned=(); [ "$3" != "-" ] && tuned=(--tuned "$3")
  phase "profile $1"
  timeout --signal=TERM --kill-after=20 $(( $(left) - 20 )) python3 experiments/h200-kernels/profile_step.py \
    --model "$MODEL" --name "$1" --streams 32 --mtp "$2" --acceptance 1.7 "${tuned[@]}" \
    --out "$RES/profile.json" >> "$RES/profile.log" 2>&1
  phase "profile $1 exit $?"
done
finish ok
