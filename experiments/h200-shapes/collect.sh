#!/usr/bin/env bash
# Here (CPU), from the repo root: merge what a poll brought back into the committed results,
# then rebuild the matrix. Step folders (study-KEY/, cross-KEY/) replace or extend the
# committed ones; the stores (Optuna, MLflow) replace them (each session's copies hold every
# earlier study: run.sh seeds them from the committed ones); session-*/ (progress, env,
# GPU samples) are kept one per session.
#   bash experiments/h200-shapes/collect.sh PATH/res.tgz [CACHE_PART...]
# CACHE_PART: compile-cache parts a poll brought back (cache-part-aa ...): they replace
# .gpu/c0, .gpu/c1, ... (ignored; three 15-MB parts a folder, so that a folder plus the
# repo tree stays under a `run` call's 64 MiB), for the next session to stage.
set -euo pipefail
TGZ=${1:?res.tgz from poll.sh}; H=experiments/h200-shapes; DST=${RESULTS:-$H/results}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar xzf "$TGZ" -C "$tmp"; SRC=$tmp/res
mkdir -p "$DST/stores" "$DST/sessions"
for d in "$SRC"/study-* "$SRC"/cross-*; do
  [ -d "$d" ] || continue
  mkdir -p "$DST/$(basename "$d")"
  find "$d" -name '*.part' -delete
  cp -r "$d"/. "$DST/$(basename "$d")/"
done
for d in "$SRC"/session-*; do [ -d "$d" ] && cp -r "$d" "$DST/sessions/"; done
for f in "$SRC"/stores/*.db; do [ -f "$f" ] && cp "$f" "$DST/stores/"; done
shift || true
if [ $# -gt 0 ]; then
  rm -rf .gpu/c[0-9]*; i=0
  for f in "$@"; do d=.gpu/c$(( i / 3 )); mkdir -p "$d"; cp "$f" "$d/"; i=$(( i + 1 )); done
  echo "cache parts: $(ls -d .gpu/c[0-9]* | tr '\n' ' ')"
fi
python3 $H/matrix.py --results "$DST" --out "${MATRIX_OUT:-$H}" > /dev/null; echo "matrix: ${MATRIX_OUT:-$H}/matrix.md"
du -sh "$DST"
