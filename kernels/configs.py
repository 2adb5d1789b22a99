"""The chosen tile sizes, pipeline depths and thread counts of every kernel: one table each.

Kernel builders take these as parameters; change a choice here, with the benchmark that
justifies it.
"""

# Chunked prefill (qla_serving.kernels.chunk_prefill).
PREFILL_CONFIGS: dict = {}

# Decode step (qla_serving.kernels.decode).
DECODE_CONFIGS: dict = {}
