#!/usr/bin/env bash
# Does a fresh H200 machine rebuild the carried FlashInfer sampling op? (2026-12-01 19:42 UTC)
# Run from the repo root after staging the bundle parts p0-p5 in ~/gpub, carrying .gpu/p6 and
# .gpu/p7 (the caches): installs the bundle, restores the caches the old way (tar -m) and the
# new way (experiments/gpu-caches.sh), and asks the machine's ninja each time what it would
# rebuild. Output: experiments/h200-kernels/results-ninja/output.txt.
set -u
cp .gpu/p6/* .gpu/p7/* ~/gpub/ && ( time bash ~/gpub/install.sh ~/gpub ~/site ) > /tmp/inst.txt 2>&1; tail -3 /tmp/inst.txt
NJ=$(find ~/site -name ninja -type f -perm -u+x 2>/dev/null | head -1); [ -n "$NJ" ] || NJ=$(which ninja); echo "ninja=$NJ $($NJ --version)"
C=$HOME/.cache/autotune; OP=flashinfer/.cache/flashinfer/0.6.14/90a/cached_ops/sampling
echo "== old restore (tar -m)"; mkdir -p $C && cat ~/gpub/cache-part-* | tar xzmf - -C $C && (cd $C/$OP && $NJ -n -d explain 2>&1 | head -4 | cut -c1-300)
rm -rf $C
echo "== new restore (gpu-caches.sh)"; bash experiments/gpu-caches.sh restore ~/gpub $C ~/site && (cd $C/$OP && $NJ -n -d explain 2>&1 | head -4 | cut -c1-300)
ls -la --time-style=full-iso ~/site/flashinfer/data/csrc | head -3; ls /usr/local/cuda/include/cuda_runtime.h -la --time-style=full-iso
