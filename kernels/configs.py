"""The chosen tile sizes, pipeline depths and thread counts of every kernel: one table each.

Kernel builders take these as parameters; change a choice here, with the benchmark that
justifies it.
"""

# Chunked prefill (qla_serving.kernels.chunk_prefill).
PREFILL_CONFIGS: dict = {}

# Decode step (qla_serving.kernels.decode).
DECODE_CONFIGS: dict = {
    # One CTA per (sequence, value head, rows_per_cta state rows); 8 lanes per row.
    "rows_per_cta": 32,
    "threads": 128,
    # Few (sequence, head) pairs: halve the tile so more CTAs share the memory latency.
    "small_rows_per_cta": 16,
    "small_threads": 128,
    "small_max_pairs": 128,
}
