#!/usr/bin/env bash
# A session's GPU work in one command, on a machine with torch and the bundles but without this
# package installed (the device machine). Writes logs and results under $OUT.
#
#   . .device/tilelang/1/env.sh && bash scripts/gpu_session.sh tests check
#   . .device/tilelang-fi/3/env.sh && bash scripts/gpu_session.sh tests bench-prefill bench-decode
#
# Steps: tests (pytest -m gpu), check (qla-serving check), bench-prefill, bench-decode.
# Extra pytest arguments: QLA_PYTEST_ARGS="-k decode".
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/qla-out}
mkdir -p "$OUT"
. "$here/scripts/gpu_stage.sh"
cd "$QLA_STAGE"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
for step in "$@"; do
  echo "== $step"
  case $step in
    tests) python3 -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" ${QLA_PYTEST_ARGS:-} \
             2>&1 | tee "$OUT/gpu-tests.log" | tail -40 ;;
    check) python3 -m qla_serving.cli check 2>&1 | tee "$OUT/check.log" ;;
    bench-prefill) python3 -m qla_serving.cli bench prefill --out-dir "$OUT" ${QLA_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-prefill.log" | tail -60 ;;
    bench-decode) python3 -m qla_serving.cli bench decode --out-dir "$OUT" ${QLA_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-decode.log" | tail -60 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
  rc=${PIPESTATUS[0]}
  ((rc == 0)) || { echo "step $step failed with $rc"; status=1; }
done
exit $status
