"""The chosen tile sizes, pipeline depths and thread counts of every kernel: one table each.

Kernel builders take these as parameters; change a choice here, with the benchmark that
justifies it.
"""

# Chunked prefill (qla_serving.kernels.chunk_prefill).
PREFILL_CONFIGS: dict = {
    # prep (grid chunk x value head): one warpgroup; the 64-row tiles are one wgmma M each
    "prep_threads": 128,
    # chunk_fwd (grid V slice x value head x work item): the serial pass with the output
    # fused in. TileLang adds a TMA producer warpgroup that prefetches fwd_stages chunks of
    # q, k, v, T diag(beta) and the gate cumsum while the consumers compute. The state rows
    # (V) are independent, so V may be split into fwd_block_v-row slices across blocks; one
    # block per (head, work item) with two consumer warpgroups instead shares the q/k/T loads
    # and puts two warps on each scheduler to hide the element-wise latency (H100, 2/8
    # 8x4096: 64-row slices with one warpgroup took 6.7 us per chunk, issue-latency bound).
    "fwd_block_v": 128,
    "fwd_threads": 256,
    "fwd_stages": 2,
    # "pipelined" (the above) or "role_split": one block per (head, item), four warpgroups
    # (state, delta values, output, TMA producer) handing off through mbarriers; registers
    # per role for setmaxnreg (sum 512 = 64K / 128 threads). DRAFT on this branch: compiles
    # for sm_90a (28 spilled words), not yet GPU-tested.
    "fwd_variant": "role_split",
    "fwd_role_nregs": (240, 120, 128, 24),
}

# Decode step (qla_serving.kernels.decode).
DECODE_CONFIGS: dict = {
    # Per pool dtype. One CTA per (sequence, value head, rows_per_cta state rows); 8 lanes
    # per row, so each thread holds rows_per_cta * 8 / threads rows. Measured on H100
    # (bench decode --sweep-tiles, e2e_bench/results/*decode-tiles*): fp32 runs at the copy
    # rate with any tile from batch 64 (within 0.5%); bf16 needs more 16-byte loads in
    # flight per thread: 32x64 gives 2834 GB/s at 16/64 heads, batch 256, against 2602 for
    # 32x128 and 2324 for 16x128. With at most small_max_pairs (sequence, head) pairs the
    # 16x128 tile (more CTAs) is fastest: 16/64 heads batch 1, 2/8 heads batch 8.
    "float32": {"rows_per_cta": 32, "threads": 128, "small_rows_per_cta": 16, "small_threads": 128},
    "bfloat16": {"rows_per_cta": 32, "threads": 64, "small_rows_per_cta": 16, "small_threads": 128},
    # At most this many (sequence, value head) pairs: the small tile, for more CTAs in flight.
    "small_max_pairs": 128,
}
