#!/usr/bin/env bash
# Carry autotune's compile and JIT caches (--cache-dir, default ~/.cache/autotune) to another
# GPU machine, e.g. an offline host, so that its first server starts are warm:
#   bash scripts/gpu/caches.sh pack CACHE DEST            CACHE as DEST/cache-part-* (15 MB parts)
#   bash scripts/gpu/caches.sh restore STAGE CACHE SITE   unpack STAGE/cache-part-* into
#        CACHE (prints its size), after dating SITE's C/C++/CUDA sources and headers back
# SITE is the folder vLLM and FlashInfer are installed in. Why the dates: FlashInfer builds its
# ops with ninja, which rebuilds an output when an input is newer than the output's mtime
# recorded in .ninja_log, or when the output on disk is newer than its entry in .ninja_deps.
# A fresh install dates every header "now", so a carried op is rebuilt on the first server
# start (about 2 minutes on an H200), and restoring with `tar -m` makes it worse: the
# outputs then post-date their deps entries. So the outputs keep their recorded dates
# (plain `tar x`), and the inputs under SITE (never the .py files: their .pyc check the
# mtime) date from 2020.
set -uo pipefail
case ${1:-} in
  restore)
    STAGE=${2:?staging dir}; CACHE=${3:?cache dir}; SITE=${4:?site dir}
    ls "$STAGE"/cache-part-* >/dev/null 2>&1 || { echo "no cache parts in $STAGE"; exit 0; }
    find "$SITE" -type f ! -name '*.py' ! -name '*.pyc' ! -name '*.so' ! -name '*.so.*' \
      -newermt '2020-01-02' -print0 2>/dev/null | xargs -0 -r touch -h -d '2020-01-01 00:00:00'
    mkdir -p "$CACHE" && cat "$STAGE"/cache-part-* | tar xzf - -C "$CACHE" \
      && echo "caches restored: $(du -sh "$CACHE" | cut -f1), $SITE's JIT sources dated 2020" ;;
  pack)
    CACHE=${2:?cache dir}; DEST=${3:?destination dir}; mkdir -p "$DEST" && rm -f "$DEST"/cache-part-*
    nice tar czf - -C "$CACHE" --exclude=quality . \
      | split -b 15M - "$DEST/cache-part-" \
      && echo "caches packed: $(du -sh "$CACHE" | cut -f1) in $(ls "$DEST" | wc -l) parts ($(du -sh "$DEST" | cut -f1))" ;;
  *) sed -n 2,6p "$0" >&2; exit 2 ;;
esac
