"""The chosen tile sizes, pipeline depths and thread counts of every kernel: one table each.

Kernel builders take these as parameters; change a choice here, with the benchmark that
justifies it.
"""

# Chunked prefill (qla_serving.kernels.chunk_prefill).
PREFILL_CONFIGS: dict = {
    # prep (grid chunk x value head): one warpgroup; the 64-row tiles are one wgmma M each
    "prep_threads": 128,
    # prep blocks per SM promised to ptxas (0: none). Unbounded, ptxas takes 202 registers (two
    # blocks, 8 warps per SM for a latency-bound kernel); 4 caps them at 128 (7 spill stores).
    # H200, 16/64 heads x 32768 tokens: 1.53 ms unbounded, 1.29 ms at 3 (168 registers), 1.21 ms at 4.
    # With the fp16 wgmma merge (35 KB of shared memory, 112 registers unbounded by 5) 5 blocks
    # fit at 96 registers without spills: prep 0.695 -> 0.654 ms at 16/64 8x4096 (6 spills 17).
    "prep_min_blocks": 5,
    # prep: floats of padding per row of the fp32 A tile in shared memory. Written from the
    # wgmma fragment eight rows at a time, a 64-float stride is an 8-way bank conflict, 72 a
    # 2-way one. H200, 16/64 x 32768: 1.21 -> 1.14 ms (with exp2 for the decay factors, 1.13).
    "prep_a_row_pad": 8,
    # chunk_fwd (grid 1 x value head x work item): registers per role for setmaxnreg, the
    # state role's two warpgroups (each), P, the TMA producer (2 x state + P + producer = 512
    # = 64K / 128 threads; a thread starts with 128). The state role holds S (64 per thread),
    # its bf16 copy and three 64 x 64 accumulators at once: 192 leaves it without spills
    # (184: 128 bytes of spills). H200 same-run A/B against 192/104/24: 200/88/24 7% slower
    # at 16/64 8x4096 and 4/16 1x32768 (no spills reported; P is close to the chain).
    "fwd_role_nregs": (192, 104, 24),
}

# Decode step (qla_serving.kernels.decode).
DECODE_CONFIGS: dict = {
    # Per pool dtype, bands of (max (sequence, value head) pairs, tile): the first band that
    # holds the call's pair count wins. Tile text ROWSxTHREADS[lLANES][bMINBLOCKS][s]: one CTA
    # per (sequence, value head, ROWS state rows), LANES lanes share a row (8 if omitted), s
    # streams the in-place update (kernels/decode.py, DecodeTile). Up to 128 pairs (16/64
    # heads batch 1, 2/8 heads batch 8..16) the 16x128 tile puts more CTAs in flight (H100
    # sweep). Above it, the H200 sweep (e2e_bench/results/2026-11-21-nvidia-h200-decode-tiles.md,
    # batch 64..512 at 16/64 and 2/8 heads) has one tile best in every cell per pool dtype:
    # fp32 8x32l32s (1.8-3.1% over the former 32x128; 95.0% of copy at 16/64 batch 256),
    # bf16 16x64s (0.3-4.0% over the former 32x64).
    "float32": {"bands": [(128, "16x128"), (None, "8x32l32s")]},
    "bfloat16": {"bands": [(128, "16x128"), (None, "16x64s")]},
}
