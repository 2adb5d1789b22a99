"""The chosen tile sizes, pipeline depths and thread counts of every kernel: one table each.

Kernel builders take these as parameters; change a choice here, with the benchmark that
justifies it. The measurements behind the present choices: ``docs/history.md`` (prefill, with
the sessions' diaries in git) and ``e2e_bench/results/2026-11-21-nvidia-h200-decode-tiles.md``.
"""

# Chunked prefill (qla_serving.kernels.chunk_prefill).
PREFILL_CONFIGS: dict = {
    # prep (grid chunk x value head): one warpgroup; the 64-row tiles are one wgmma M each
    "prep_threads": 128,
    # prep blocks per SM promised to ptxas: 5 fit at 96 registers without spills, and a
    # latency-bound kernel wants the warps (unbounded, ptxas takes 112 and only 4 fit)
    "prep_min_blocks": 5,
    # floats of padding per row of prep's fp32 A tile in shared memory: written from the wgmma
    # fragment eight rows at a time, a 64-float stride is an 8-way bank conflict, 72 a 2-way one
    "prep_a_row_pad": 8,
    # chunk_fwd's registers per role for setmaxnreg: each of the state's two warpgroups, P, the
    # TMA producer (2 x 192 + 104 + 24 = 512 = 64K / 128 threads). The state holds S, its bf16
    # copy and three 64 x 64 accumulators at once: 192 is the least without spills
    "fwd_role_nregs": (192, 104, 24),
}

# Decode step (qla_serving.kernels.decode).
DECODE_CONFIGS: dict = {
    # Per pool dtype, bands of (max (sequence, value head) pairs, tile): the first band that
    # holds the call's pair count wins. Tile text ROWSxTHREADS[lLANES][bMINBLOCKS][s]: one CTA
    # per (sequence, value head, ROWS state rows), LANES lanes share a row (8 if omitted), s
    # streams the in-place update (kernels/decode_program.py, DecodeTile). Small calls (<= 128 pairs)
    # want more CTAs in flight. A pool dtype's bands share one lane count, which alone sets a row's
    # summation order, so a sequence decodes to the same bits alone and in any batch (float32's
    # 8x32s is 0.5-0.7% behind the sweep's fastest, 8x32l32s, whose 32 lanes would break that).
    "float32": {"bands": [(128, "16x128"), (None, "8x32s")]},
    "bfloat16": {"bands": [(128, "16x128"), (None, "16x64s")]},
}

# The precompiled kernel library the wheel ships (qla_serving.kernels.library; built by
# `qla-serving compile --shipped`): the per-rank GDN heads of the released hybrid Qwen models
# (Qwen3-Next, Qwen3.5, Qwen3.6: 16 q/k heads and 16, 32, 48 or 64 value heads) at tensor
# parallelism 1, 2, 4 and 8, for each engine's ways of calling the kernels (vLLM's packed prefill
# too), every activation and state dtype, and speculative verify of 1, 2, 3, 4 and 8 draft tokens
# (MTP's usual settings). A configuration outside it is compiled with TileLang when a validated
# TileLang is installed.
SHIPPED_CONFIGS: dict = {
    "qk_heads": 16,
    "v_heads": (16, 32, 48, 64),
    "tp": (1, 2, 4, 8),
    "engines": ("vllm", "sglang"),
    "dtypes": ("bf16", "fp16"),
    "states": ("fp32", "bf16"),
    "verify_tokens": (2, 3, 4, 5, 9),
}
