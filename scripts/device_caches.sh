#!/usr/bin/env bash
# Keeps the device machine's JIT caches between sessions (scripts/gpu_session.sh caches-save and
# caches-restore): a fresh machine then starts its servers without compiling Triton's and
# FlashInfer's kernels again.
#
#   scripts/device_caches.sh store /work/.device/N   # the pieces a caches-save call returned
#   scripts/device_caches.sh list                     # what is kept, and the carry of each call
#
# The pieces go into .device/jit-caches/K (ignored by git), at most three (45 MiB) per folder so
# that each folder travels in one call beside the tree: carry .device/jit-caches/1 in one call
# with `bash scripts/gpu_session.sh caches-restore`, then /2 in the next, and so on; the last one
# unpacks them.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
keep=$root/.device/jit-caches
per_folder=${QLA_CACHE_PIECES_PER_CALL:-3}

case ${1:-} in
  store)
    src=${2:?the folder the files of a caches-save call came back to}
    [[ -f $src/jit-caches.count ]] || { echo "no jit-caches.count in $src: not a caches-save call's files" >&2; exit 2; }
    read -r n _ <"$src/jit-caches.count"
    pieces=("$src"/jit-caches.tar.xz.*)
    ((${#pieces[@]} == n)) || { echo "$src holds ${#pieces[@]} of $n pieces" >&2; exit 2; }
    rm -rf "$keep" && mkdir -p "$keep"
    for i in "${!pieces[@]}"; do
      dir=$keep/$((i / per_folder + 1))
      mkdir -p "$dir" && cp "${pieces[$i]}" "$dir/" && cp "$src/jit-caches.count" "$dir/"
    done
    chmod -R u+w "$keep"
    "$0" list ;;
  list)
    [[ -d $keep ]] || { echo "no JIT caches kept (.device/jit-caches)"; exit 0; }
    for dir in "$keep"/*/; do
      echo "carry .device/jit-caches/$(basename "$dir"): $(du -sh "$dir" | cut -f1), $(ls "$dir" | grep -c tar.xz) pieces"
    done ;;
  *) echo "usage: $0 store DIR | list" >&2; exit 2 ;;
esac
