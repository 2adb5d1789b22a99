"""The chosen tile sizes, pipeline depths and thread counts of every kernel: one table each.

Kernel builders take these as parameters; change a choice here, with the benchmark that
justifies it.
"""

# Chunked prefill (qla_serving.kernels.chunk_prefill).
PREFILL_CONFIGS: dict = {
    # one warpgroup (128 threads) per block: the 64-row tiles are one wgmma M each
    "prep_threads": 128,
    "output_threads": 128,
    # state pass: V split into 64-row slices (2 blocks per (sequence, head)); TileLang adds
    # a TMA producer warpgroup and double-buffers the next chunk's w, k, u (H100: tests pass,
    # 1.8 ms of the 2.4 ms total at 2/8 1x32768, ~2.0 ms at 16/64 8x4096)
    "state_block_v": 64,
    "state_threads": 128,
    "state_stages": 2,
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
