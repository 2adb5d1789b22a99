#!/usr/bin/env bash
# Pack SGLang 0.5.17 (torch 2.11, as on the GPU machine) and what it imports that the GPU image
# lacks into .device/sglang/K/ parts that ../shared/device/load-bundle.sh loads there:
#
#   scripts/sglang_bundle.sh            # build .device/sglang (skipped when current)
#   scripts/sglang_bundle.sh --check    # also import the needed modules from a CPU-side twin
#
# Same layout and loader as ../shared/device/make-bundle (part, stamp, count, index, env.sh),
# which this cannot call: SGLang 0.5.17's wheels are manylinux_2_34 (the image is Ubuntu 24.04,
# glibc 2.39) and make-bundle asks for 2_28 at most. Left out (large, and unused by the served models):
#   sgl_kernel/flash_ops.abi3.so (1.1 GB, FA3: use --attention-backend triton, which
#   e2e_bench/serve.py passes when the library is absent), sm100/ (Blackwell),
#   flashmla_ops, infllm_ops (DeepSeek MLA / InfLLM attention), xgrammar/lib (a static library),
#   sglang/multimodal_gen (diffusion serving), the test suites of FlashInfer's CUTLASS and CCCL
#   sources, multiprocess, dill, jsonschema and referencing (never imported; keeps one part).
#   FlashInfer's JIT sources (flashinfer/data, 76 MB, 4.7 MB packed) stay: sgl-kernel's rmsnorm
#   calls FlashInfer's, which an engine compiles there.
#
# --check needs a CPython 3.11 whose site-packages hold torch 2.11 (QLA_TORCH211_SITE, default
# the vLLM 0.26 venv of scripts/ci_vllm.sh): it unpacks the cp311 wheels of the same list into
# a scratch dir, with the bundle loaded before it on the GPU machine ahead of it (TileLang-FI),
# builds an emulation of the GPU image (only the packages the image lists, linked from that venv
# and the SGLang CI venv), pretends an SM90 GPU so SGLang's import-time `if _is_cuda:` branches
# run, loads sgl_kernel's SM90 library against torch 2.11 through a stand-in libcuda, imports the
# modules of scripts/sglang_bundle_check.py and runs the serving benchmark's CPU-side steps (its
# server command through SGLang's argument resolution for every backend, model config and class,
# tokenizer and grammar backend, its client command and random dataset). What it cannot prove:
# that the kernels run (no GPU), what the engine imports lazily past those steps, and the cp312
# builds of the compiled wheels (the twin is cp311 of the same versions).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
here=$root/scripts
reqs_file=$here/sglang_bundle.txt
out=$root/.device part_mib=48 name=sglang
drops=(sgl_kernel/flash_ops.abi3.so sgl_kernel/sm100 sgl_kernel/flashmla_ops.abi3.so
  'sgl_kernel/infllm_ops.*.so' xgrammar/lib sglang/multimodal_gen
  flashinfer/data/cutlass/test flashinfer/data/cccl/python/cuda_cccl/tests flashinfer/data/cccl/libcudacxx/test
  multiprocess/tests dill/tests jsonschema/tests referencing/tests)
check=0
[[ ${1:-} == --check ]] && check=1
reqs=$(sed 's/#.*//; s/[[:space:]]*$//; /^$/d' "$reqs_file" | sort -u)
platforms=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

download_unpack() { # PYVER DEST_SITE
  local wheels=$2.wheels
  mkdir -p "$wheels" "$2"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$1" --implementation cp \
    "${platforms[@]}" -d "$wheels" $reqs 2>&1 | grep -v '^WARNING: Location' || true
  # pip's errors are swallowed above with its warnings: a requirement without a wheel fails here
  local got want
  got=$(find "$wheels" -name "*.whl" | wc -l) want=$(echo "$reqs" | wc -l)
  ((got == want)) || { echo "sglang_bundle: $got wheels for $want requirements (Python $1) in $wheels"; exit 1; }
  for w in "$wheels"/*.whl; do unzip -q -o "$w" -d "$2"; done
  for d in "${drops[@]}"; do (cd "$2" && rm -rf $d); done
}

stamp=$(printf '%s\n' "$name" "$reqs" "${drops[@]}" manylinux_2_34 | sha256sum | cut -c1-16)
dest=$out/$name
if [[ -f $dest/1/stamp && $(cat "$dest/1/stamp") == "$stamp" ]]; then
  echo "sglang_bundle: $dest is current: $(ls -d "$dest"/*/ | wc -l) part(s)"
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  download_unpack 3.12 "$work/site"
  tar -C "$work/site" -cf - . | xz -9 -T0 | split -b "${part_mib}M" -d -a 2 - "$work/part."
  parts=("$work"/part.*)
  rm -rf "$dest" && mkdir -p "$dest"
  for i in "${!parts[@]}"; do
    k=$((i + 1)) && mkdir -p "$dest/$k"
    mv "${parts[$i]}" "$dest/$k/part"
    echo "$stamp" >"$dest/$k/stamp" && echo "${#parts[@]}" >"$dest/$k/count" && echo "$k" >"$dest/$k/index"
    cp "$root/../shared/device/load-bundle.sh" "$dest/$k/env.sh"
  done
  echo "sglang_bundle: $dest: ${#parts[@]} part(s):"
  du -h "$dest"/*/part | sed 's/^/  /'
fi
((check)) || exit 0

# ---- CPU-side check --------------------------------------------------------------------------
scratch=${QLA_SGLANG_CHECK_DIR:-/tmp/qla-sglang-bundle-check}
torch_site=${QLA_TORCH211_SITE:-$HOME/.cache/qla-serving/venv-vllm-0.26.0/lib/python3.11/site-packages}
extra_site=${QLA_SGLANG_SITE:-$HOME/.cache/qla-serving/sglang-0.5.23-venv/lib/python3.11/site-packages}
py311=${QLA_PY311:-python3.11}
[[ -d $torch_site/torch ]] || { echo "sglang_bundle --check: no torch in $torch_site (set QLA_TORCH211_SITE)"; exit 2; }
# The bundle loaded before this one on the GPU machine, whose packages come first there: by default
# the TileLang-FI bundle (TileLang 0.1.15, apache-tvm-ffi 0.1.12, FLA 0.6.0, FlashInfer 0.6.14 and
# its CuTe DSL), the one the serving benchmark runs after; QLA_SGLANG_BASE_REQS="" checks with
# apache-tvm-ffi alone ahead (the plain TileLang bundle of the acceptance run imports the same).
base_reqs_files=${QLA_SGLANG_BASE_REQS-$root/../shared/device/bundle.txt $root/../shared/device/flashinfer.txt}
base_reqs=apache-tvm-ffi==0.1.12
[[ -z $base_reqs_files ]] || base_reqs=$(cat $base_reqs_files | sed 's/#.*//; s/[[:space:]]*$//; /^$/d' | sort -u)
check_stamp=$(printf '%s\n' "$stamp" "$base_reqs" | sha256sum | cut -c1-16)
if [[ ! -f $scratch/stamp || $(cat "$scratch/stamp") != "$check_stamp" ]]; then
  rm -rf "$scratch" && mkdir -p "$scratch"
  download_unpack 3.11 "$scratch/bundle"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    "${platforms[@]}" -d "$scratch/tl.wheels" $base_reqs 2>&1 | grep -v '^WARNING: Location' || true
  mkdir -p "$scratch/tilelang" && for w in "$scratch"/tl.wheels/*.whl; do unzip -q -o "$w" -d "$scratch/tilelang"; done
  echo "$check_stamp" >"$scratch/stamp"
fi
echo "sglang_bundle --check: ahead of this bundle: $(echo $base_reqs)"
# The image's package names and, on a second line, the versions a session saw there (KINDS.md).
kinds=${QLA_DEVICE_KINDS:-/work/.library/device/KINDS.md}
{ sed -n 's/.*Packages: //p' "$kinds" | head -1; grep -m1 'pip list, as a session saw it' "$kinds"; } >"$scratch/image-packages.txt"
rm -rf "$scratch/image" && mkdir -p "$scratch/image"
"$py311" "$here/sglang_bundle_check.py" image "$scratch/image" "$scratch/image-packages.txt" "$torch_site" "$extra_site"
# sgl_kernel's SM90 library and DeepGEMM's extension link libcuda.so.1 (the driver): a stand-in
# whose entry points all fail lets them load here, which runs their torch op registration against
# torch 2.11.
nm -D --undefined-only "$scratch"/bundle/sgl_kernel/sm90/common_ops.abi3.so "$scratch"/bundle/sgl_kernel/spatial_ops.abi3.so \
  "$scratch"/bundle/deep_gemm/*.so |
  awk '{print $2}' | sed 's/@.*//' | grep -E '^cu[A-Z]' | sort -u |
  awk 'BEGIN{print "/* libcuda stand-in for a CPU-only load check */"} {print "int " $1 "(void){return 999;}"}' >"$scratch/cuda_stub.c"
mkdir -p "$scratch/stub" && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$scratch/stub/libcuda.so.1" "$scratch/cuda_stub.c"
QLA_STAGE=$scratch/stage . "$here/gpu_stage.sh"
LD_LIBRARY_PATH=$scratch/stub "$py311" -S "$here/sglang_bundle_check.py" import \
  "$scratch/stage" "$scratch/tilelang" "$scratch/bundle" "$scratch/image"
