"""Print a SHA-256 of the CUDA source TileLang generates for each kernel of a few static
configurations (compiled for sm_90a; no GPU needed, nvcc must be installed).

Run it on two trees to show a change left the kernels' generated code byte-identical. Each tree
staged (``QLA_STAGE=/tmp/stage-a . scripts/gpu_stage.sh``), then, from a directory outside both
and with ``-S`` so that an editable install of this package cannot stand in for the staged one:

    PYTHONPATH=/tmp/stage-a:<site-packages with tilelang and torch> python -S kernel_sources.py
"""

import hashlib
import sys

import torch

from qla_serving.kernels import chunk_prefill, decode

PREFILL = [(16, 32, "bfloat16", "float32", "bfloat16", True), (2, 8, "bfloat16", "float32", "float32", True),
           (16, 64, "float16", "float16", "float32", False)]
DECODE = [(16, 32, 1, torch.bfloat16, torch.bfloat16, "16x64s"), (16, 48, 4, torch.bfloat16, torch.float32, "8x32s"),
          (2, 8, 1, torch.float16, torch.float32, "16x128")]


def digest(kernel) -> str:
    return hashlib.sha256(kernel.get_kernel_source().encode()).hexdigest()[:16]


def main() -> int:
    for h, hv, dt, beta, pool, l2 in PREFILL:
        cfg = chunk_prefill.PrefillStaticConfig(h, hv, dt, beta, pool, l2)
        prep, fwd = chunk_prefill._kernel_set(cfg)
        print(f"prefill {h}/{hv} {dt} beta={beta} pool={pool} l2={l2}: prep {digest(prep)} chunk_fwd {digest(fwd)}", flush=True)
    for h, hv, t, dt, pool, tile in DECODE:
        key = decode._key(h, hv, t, dt, dt, torch.float32, torch.float32, pool, torch.int32, True, t > 1, t == 1,
                          decode.DecodeTile.parse(tile))
        print(f"decode {h}/{hv} T={t} {dt} pool={pool} {tile}: {digest(decode._get_kernel(key))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
