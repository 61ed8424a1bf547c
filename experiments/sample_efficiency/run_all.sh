#!/usr/bin/env bash
# Every result file of this benchmark, from the repo root: bash experiments/sample_efficiency/run_all.sh
# (about 1-1.5 hours on 2 shared CPU cores; no GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
R=experiments/sample_efficiency/run.py
$PY $R --seeds 50 --budget 300                                  # results.json: the headline
$PY $R --seeds 30 --budget 300 --noise 0 --tag noise0            # no measurement noise
$PY $R --seeds 30 --budget 300 --noise 0.10 --tag noise10        # 10 % noise
$PY $R --seeds 30 --budget 300 --mtp2-acceptance 1.9 --tag mtp1best   # MTP 1 the best depth
$PY $R --seeds 30 --budget 300 --variants startup5,startup20,independent,nogroup,endpoints \
    --tag variants                                               # other TPE settings
