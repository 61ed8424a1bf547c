#!/usr/bin/env bash
# On the GPU host, from the repo root: wait until run.sh is DONE or step $2 has finished
# (study:KEY / cross:KEY, or DONE; default DONE), at most $1 s (default 540: a `run` call
# lasts at most 600 s), then bring back what run.sh has written so far as $OUT/res.tgz (the
# results, small: JSON, logs' heads and tails, gzipped GPU samples); further arguments name
# compile-cache parts (~/res-cache/cache-part-*, or "caches" for all of them) to bring back
# too: at most 7 with res.tgz, the 8 files a call may return.
#   bash experiments/h200-shapes/poll.sh 540 study:casestudy
#   bash experiments/h200-shapes/poll.sh 300 DONE caches
RES=${RES:-$HOME/res}; T=${1:-540}; WHAT=${2:-DONE}
step_done() {
  [ -f "$RES/DONE" ] && return 0
  case $WHAT in
    DONE) return 1 ;;
    *) [ -f "$RES/${WHAT/:/-}/step.json" ] ;;
  esac
}
. experiments/poll-lib.sh; wait_for "$RES" "$T" step_done; rc=$?
S=$(ls -d "$RES"/session-* 2>/dev/null | tail -1)
tail -n 25 "$S/progress.txt" 2>/dev/null
L=$(ls -t "$RES"/study-*/tune.log 2>/dev/null | head -1); [ -n "$L" ] && { echo "== $L"; tail -c 1500 "$L"; }
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
tar czf "${OUT:-/tmp}/res.tgz" -C "$(dirname "$RES")" "$(basename "$RES")" 2>/dev/null
ls -la "${OUT:-/tmp}/res.tgz"; ls -la "$HOME/res-cache" 2>/dev/null
n=0
for f in "${@:3}"; do
  if [ "$f" = caches ]; then set -- $(ls "$HOME/res-cache" 2>/dev/null); else set -- "$f"; fi
  for g in "$@"; do
    [ $n -lt 7 ] && cp "$HOME/res-cache/$g" "${OUT:-/tmp}/" 2>/dev/null && n=$((n + 1))
  done
done
if [ -f "$RES/DONE" ]; then echo "run.sh DONE"; elif [ "$rc" = 3 ]; then echo "run.sh NOT running"; else echo "run.sh still running"; fi
[ "$rc" = 3 ] && exit 3 || exit 0
