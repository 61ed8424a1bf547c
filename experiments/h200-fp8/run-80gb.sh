#!/usr/bin/env bash
# The FP8 question on an 80-GB card (H100 80GB), where vLLM's defaults cannot start the 30B
# stand-in (BF16 weights 61.8 GB; the default batch of 1024 sequences does not fit): the
# baseline is vLLM's defaults + --max-num-seqs 128, the candidate FP8 weights at
# --max-num-seqs 256 (space-80gb.yaml). Same traffic, stop rule, re-checks and verdict rule
# as run.sh (README.md, "On an 80-GB card").
#   bash experiments/h200-fp8/run-80gb.sh RESULTS_DIR [SECONDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
export SPACE=experiments/h200-fp8/space-80gb.yaml ENQUEUE='{"quantization": "fp8"}'
export STUDY=fp8-80gb RUN=${RUN:-$HOME/run-fp8-80gb}
exec bash experiments/h200-fp8/run.sh "$@"
