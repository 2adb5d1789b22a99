#!/usr/bin/env bash
# On the lent GPU machine, from the repository root, once the TileLang and SGLang bundles are
# loaded (docs/gpu-machine.md, "SGLang acceptance"):
#
#   bash scripts/sglang_gpu_accept.sh tests                      # steps 1 and 2
#   bash scripts/sglang_gpu_accept.sh engine [sglang_offline.py args...]   # steps 1 and 3
#
# 1. records the GPU, driver, glibc and the versions that import (torch, triton, TileLang,
#    SGLang, sgl-kernel, transformers, FlashInfer) and imports every SGLang module the adapter,
#    the GPU test and an offline engine use, on the real GPU (scripts/sglang_bundle_check.py gpu);
# 2. runs tests/sglang/test_sglang_gpu.py with QLA_STRICT=1 (a fallback to the reference or to
#    triton is an error): FlashQLAGDNKernel through SGLang's interface against the float64
#    oracle and SGLang's own triton kernel, CUDA-graph capture of decode, start-up binding;
# 3. the offline engine comparison, e2e_bench/sglang_offline.py (needs FlashInfer's JIT sources:
#    load the tilelang-fi bundle instead of tilelang, see docs/gpu-machine.md).
# Logs and results go to $OUT (sglang-gpu-env.log, sglang-gpu-tests.log, sglang-offline.log, ...).
# Exit status: 0, or the first failing step's number.
set -uo pipefail
mode=${1:-tests}
shift || true
out=${OUT:-/tmp/qla-sglang-out}
mkdir -p "$out"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# A precompiled TileLang cache carried with the tree (the lead's .tlcache/final) or kept in /tmp
# by an earlier call on the same machine.
if [[ -d $root/.tlcache/final ]]; then
  export TILELANG_CACHE_DIR=$root/.tlcache/final
elif [[ -d /tmp/qla-tlcache ]]; then
  export TILELANG_CACHE_DIR=/tmp/qla-tlcache
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
. "$root/scripts/gpu_stage.sh"
status=0
{
  echo "mode=$mode TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-(none)} QLA_BUNDLES=${QLA_BUNDLES:-(none)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ldd --version | head -1
  python3 "$root/scripts/sglang_bundle_check.py" gpu
} 2>&1 | tee "$out/sglang-gpu-env.log"
((PIPESTATUS[0] == 0)) || status=1
case $mode in
  tests)
    # QLA_REQUIRE_SGLANG=1: an SGLang that does not import fails instead of skipping the directory
    (cd "$QLA_STAGE" && QLA_STRICT=1 QLA_REQUIRE_SGLANG=1 timeout 420 python3 -m pytest -q -rA \
      -p no:cacheprovider tests/sglang/test_sglang_gpu.py 2>&1) | tee "$out/sglang-gpu-tests.log"
    ((PIPESTATUS[0] == 0 || status)) || status=2
    # A skipped GPU test (no SM90 GPU seen, TileLang not importable) is a failed acceptance here.
    if grep -Eq '[0-9]+ skipped' "$out/sglang-gpu-tests.log"; then
      echo "sglang_gpu_accept: GPU tests were skipped (see the reasons above)"
      ((status)) || status=2
    fi
    ;;
  engine)
    (cd "$QLA_STAGE" && python3 e2e_bench/sglang_offline.py --out-dir "$out" "$@" 2>&1) | tee "$out/sglang-offline.log"
    ((PIPESTATUS[0] == 0 || status)) || status=3
    ;;
  *) echo "sglang_gpu_accept: unknown mode '$mode' (tests | engine)"; status=64 ;;
esac
echo "sglang_gpu_accept: exit $status"
exit $status
