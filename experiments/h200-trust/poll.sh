#!/usr/bin/env bash
# Wait for run.sh (at most $1 s), then bring back what it has written so far; further
# arguments name compile-cache parts (~/res-cache/cache-part-*) to bring back too.
RES=${RES:-$HOME/res}; T=${1:-540}  # RES: a second job's folder, e.g. RES=~/res2
done_() { [ -f "$RES/DONE" ]; }; . experiments/poll-lib.sh; wait_for "$RES" "$T" done_; rc=$?
cat "$RES/progress.txt" 2>/dev/null; log=$(ls -t "$RES"/tune.log "$RES"/*/tune.log 2>/dev/null | head -1)  # run.sh: RES; proof-x2.sh: RES/<study>
[ -n "$log" ] && tail -c 3000 "$log"; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
tar czf "$OUT/res.tgz" -C "$(dirname "$RES")" "$(basename "$RES")" 2>/dev/null; ls -la "$RES"; ls -la "$HOME/res-cache" 2>/dev/null
for f in "${@:2}"; do cp "$HOME/res-cache/$f" "$OUT/" 2>/dev/null; done
[ "$rc" = 3 ] && exit 3 || exit 0
