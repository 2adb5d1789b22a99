"""Chunked gated-delta-rule prefill forward for SM90: the TileLang programs.

The math is ``docs/design.md``'s chunked form with 64-token chunks, rearranged so that the
only per-chunk matrix the serial pass needs from a preparation step is ``T diag(beta)``:
with ``T = (I + A)^-1`` and the state ``h`` entering the chunk,
``v' = u - w h = T diag(beta) (v - exp(G) k h)``. Two kernels, each compiled once per static
configuration (head counts, dtypes, pool dtype, flags); the token count, the number of
sequences and their lengths are runtime values read from the plan's device tables, so a new
batch composition compiles nothing and syncs nothing.

* ``prep`` — grid (chunk, value head), fully parallel: gate cumsum inside the chunk, the
  inverse q/k L2 norms (``[chunks, H, 2, 64]``, written once per q/k head; q and k themselves
  stay raw), ``A = strict_lower(beta k k^T exp(G_i - G_j))``,
  ``T = (I + A)^-1`` (16x16 diagonal blocks by forward substitution in registers, merged with
  four fp16 products, three of them with the left factor in registers), ``T diag(beta)`` —
  8 KiB per chunk and head, in a per-chunk table ``[chunks, HV, 64, 64]`` next to the gate
  cumsum ``[chunks, HV, 64]``.
* ``chunk_fwd`` — grid (1, value head, work item): the serial chunk-to-chunk pass with the
  output fused in, the state kept in registers (fp32) for the whole item. Three roles hand off
  through mbarriers: the state (two warpgroups, each 64 rows of V of S in its accumulators;
  every product of a chunk taken transposed, V as its M dimension, so that each result is the
  next product's A operand in registers: ``S k^T``, ``S q^T``, ``v'^T``, the output and the
  update never pass through shared memory), P (``q k^T`` masked and decayed, and the chunk's
  per-token factors, up to two chunks ahead), and a TMA producer filling the next stage. The
  two state warpgroups take turns issuing their first products (named barriers), so that one's
  element-wise steps overlap the other's products; a chunk's output leaves one chunk later,
  transposed by stmatrix into a shared tile and one TMA store per warpgroup. The state never
  crosses warpgroups: handing it (and ``v'``) over through shared memory every chunk costs more
  cycles per chunk than the products it would free (docs/prefill-performance.md).
  No per-chunk state goes to memory: the initial state is read from the engine's pool, the
  final state written back in place, checkpoints written at the plan's chunk boundaries.
  It is launched as ``prep``'s programmatic dependent (``pdl_trigger`` / ``pdl_sync``): its
  blocks take SMs while ``prep``'s last wave drains and wait before reading ``prep``'s outputs.

Work items and AutoCP: ``chunk_fwd`` runs one item per block column, ``(sequence, first
chunk, first output chunk, end chunk)`` from the plan. Without context parallelism an item
is a whole sequence. With it (``qla_serving.plan.plan_context_parallel``), a
long sequence is several items that run side by side; an item starting inside the sequence
begins from a zero state a few warm-up chunks before its first output chunk (those chunks run
only the state's chain: no P, no output). Whether that warm-up is exact enough is decided in
the kernel, per head, from the actual gates: where the window's total log decay is above the
threshold, the item replays from the sequence start instead (exact, no speedup for that head).

All matrix products are ``T.gemm`` / ``T.wgmma_gemm`` on 64-row tiles per warpgroup, lowered
to wgmma (HGMMA in the SASS, no HMMA). The triangular merge's four products take fp16 operands: fp32 ones went to mma.sync
(every warp loading all of B from shared memory), and fp16 keeps tf32's 10-bit mantissa.
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel signatures' annotations.
# This file, configs.py's PREFILL_CONFIGS and constants.py are what a kernel library is built from
# (their code is its digest, library.SOURCE_FILES): selection, loading and launch are in chunk_prefill.py.
from dataclasses import dataclass

from ..constants import CHUNK_SIZE as CHUNK
from ..constants import HEAD_DIM, L2NORM_EPS, SOFTPLUS_THRESHOLD
from .configs import PREFILL_CONFIGS

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): one MUFU instruction
MERGE_DTYPE = "float16"  # prep's triangular-inverse merge operands (see _build_prep)


@dataclass(frozen=True)
class PrefillStaticConfig:
    """Everything a compiled prefill kernel set depends on; all else is a runtime value."""

    num_qk_heads: int
    num_v_heads: int
    dtype: str  # activations q, k, v, o: "bfloat16" | "float16"
    beta_dtype: str  # "float32" or the activation dtype
    pool_dtype: str  # state pool and checkpoints: "float32" | "bfloat16"
    use_qk_l2norm: bool
    # None: q, k, v are contiguous tensors and the gates g, beta are given. (A_log dtype, dt_bias
    # dtype): the engine's own buffers, read in place: q, k and v as the column ranges of its
    # packed conv output [T, (2H + HV) K] (rows contiguous), and g, beta made in prep from its
    # gate inputs a and b (any token stride) with the layer's A_log and dt_bias, so that no pass
    # splits, normalises and gates them first. Needs use_qk_l2norm (the conv output is raw).
    packed_inputs: tuple = None


def _target():
    from tvm.target import Target

    # sm_90a explicitly: wgmma needs the arch-specific target; this also compiles without a GPU.
    return Target({"kind": "cuda", "arch": "sm_90a"})


def _pass_configs(fast_math: bool = False):
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: fast_math}


# --------------------------------------------------------------------------------------
# Kernel builders
# --------------------------------------------------------------------------------------


def _build_prep(cfg: PrefillStaticConfig, threads: int, min_blocks: int = 0, a_row_pad: int = 0):
    import tilelang.language as T
    from tilelang.cuda.language import pdl_trigger
    from tilelang.layout import make_swizzled_layout

    H, HV, K, C = cfg.num_qk_heads, cfg.num_v_heads, HEAD_DIM, CHUNK
    ratio = HV // H
    dt, bdt, f32 = cfg.dtype, cfg.beta_dtype, "float32"
    l2 = cfg.use_qk_l2norm
    NT = T.dynamic("num_tokens", "int64")
    NC = T.dynamic("num_chunks", "int64")
    BLK = 16  # diagonal block size of the triangular solve
    packed = cfg.packed_inputs is not None
    if packed and not l2:
        raise ValueError("packed inputs are the raw conv output: they need use_qk_l2norm")
    QKV = (2 * H + HV) * K  # a packed conv output row: q, k, v columns

    def softplus(x):
        return T.if_then_else(x > SOFTPLUS_THRESHOLD, x, T.log1p(T.exp(x)))

    @T.macro
    def rnorm_from_diag(gram_f, rnorm_s):
        # 1 / |x_i| from the diagonal of x x^T (a wgmma accumulator): the thread that holds
        # element (i, i) writes it
        for i, j in T.Parallel(C, C):
            if i == j:
                rnorm_s[i] = T.rsqrt(gram_f[i, j] + L2NORM_EPS)

    @T.macro
    def prep_body(q, k, g, beta, A_log, dt_bias, a_stride, b_stride, chunk_bounds, t_beta, g_cum, qk_rnorm):
        # packed: q and k are the conv output [NT, QKV], g and beta the flat gate inputs a and b
        with T.Kernel(NC, HV, threads=threads) as (ic, hv):
            # chunk_fwd may launch once every prep block has started (programmatic dependent
            # launch): its blocks take SMs as prep's last wave drains, and wait in pdl_sync
            pdl_trigger()
            if min_blocks:
                # blocks per SM promised to ptxas: caps registers at 64K / (min_blocks x threads)
                T.annotate_min_blocks_per_sm(min_blocks)
            hk = hv // ratio
            bos = chunk_bounds[ic, 0]
            L = T.min(chunk_bounds[ic, 1] - bos, C)

            k_s = T.alloc_shared((C, K), dt)
            q_s = T.alloc_shared((C, K), dt)
            g_s = T.alloc_shared((C,), f32)
            G_s = T.alloc_shared((C,), f32)
            b_s = T.alloc_shared((C,), f32)
            rk_s = T.alloc_shared((C,), f32)  # 1 / |k_i| (1 without the L2 norm)
            rq_s = T.alloc_shared((C,), f32)  # 1 / |q_i|
            ea_s = T.alloc_shared((C,), f32)  # A's per-row exponent
            eb_s = T.alloc_shared((C,), f32)  # A's per-column exponent
            A_f = T.alloc_fragment((C, C), f32)
            # strict lower A, fp32; rows padded by a_row_pad floats: written from the wgmma
            # fragment, eight rows at a time, a 64-float row stride puts them all in one bank
            A_s = T.alloc_shared((C, C + a_row_pad), f32)
            # the merge's operands in fp16: wgmma reads them once per warpgroup (tf32 went to
            # mma.sync, every warp loading all of B: ~5x the shared-memory traffic), and fp16
            # keeps tf32's 10-bit mantissa; the factors stay within |x| <= ~2 (unit k,
            # beta <= 1; largest seen 2.0 over 1000 random, rank-2 and repeated-k chunks).
            Dinv_s = T.alloc_shared((C, C), MERGE_DTYPE)  # inverse of the 16x16 diagonal blocks
            N_s = T.alloc_shared((C, C), MERGE_DTYPE)  # N
            X_s = T.alloc_shared((C, C), MERGE_DTYPE)  # P
            W_s = T.alloc_shared((C, C), MERGE_DTYPE)  # I + P^2
            P_f = T.alloc_fragment((C, C), f32)
            # element-wise results on their way to shared memory (never written into a wgmma
            # accumulator: ptxas would serialise every wgmma of the kernel)
            M_f = T.alloc_fragment((C, C), f32)
            Mh_f = T.alloc_fragment((C, C), MERGE_DTYPE)
            Mh2_f = T.alloc_fragment((C, C), MERGE_DTYPE)
            col = T.alloc_local((BLK,), f32)
            Tb_f = T.alloc_fragment((C, C), dt)
            Tb_s = T.alloc_shared((C, C), dt)  # T diag(beta), for one bulk (TMA) store
            # swizzled: the fragment's stmatrix writes eight 128-byte rows at once, one bank
            # group without it
            T.annotate_layout({Tb_s: make_swizzled_layout(Tb_s)})
            loaded = T.alloc_barrier(threads)  # k's and q's tiles (TMA)

            # ---- loads first, all in flight together: k and q by TMA (no registers, no
            # per-thread copy instructions: those were a sixth of this kernel's), the gates by
            # 64 threads. Rows past the chunk's end are the next sequence's (or zeros past the
            # batch): they are never written out, and in A they meet beta = 0 or the mask.
            if packed:
                T.tma_copy(k[bos : bos + C, (H + hk) * K : (H + hk + 1) * K], k_s, barrier=loaded)
                if hv % ratio == 0:
                    T.tma_copy(q[bos : bos + C, hk * K : (hk + 1) * K], q_s, barrier=loaded)
            else:
                T.tma_copy(k[bos : bos + C, hk, :], k_s, barrier=loaded)
                if l2:
                    if hv % ratio == 0:
                        T.tma_copy(q[bos : bos + C, hk, :], q_s, barrier=loaded)
            T.barrier_arrive(loaded)
            if packed:
                # the gates from the engine's a and b: g = -exp(A_log) softplus(a + dt_bias),
                # beta = sigmoid(b) (each load under its row's test: rows past the chunk's end
                # may lie past the batch)
                for i in T.Parallel(C):
                    g_s[i] = T.if_then_else(
                        i < L,
                        -T.exp(T.cast(A_log[hv], f32)) * softplus(
                            T.cast(g[(bos + i) * a_stride + hv], f32) + T.cast(dt_bias[hv], f32)),
                        0.0)
                    b_s[i] = T.if_then_else(
                        i < L, 1.0 / (1.0 + T.exp(-T.cast(beta[(bos + i) * b_stride + hv], f32))), 0.0)
            else:
                for i in T.Parallel(C):
                    g_s[i] = T.if_then_else(i < L, g[bos + i, hv], 0.0)
                    b_s[i] = T.if_then_else(i < L, T.cast(beta[bos + i, hv], f32), 0.0)
            T.clear(Dinv_s)  # the substitution below writes the diagonal blocks
            # inclusive cumsum of the gate inside the chunk (past the chunk's end g = 0: G stays flat)
            T.cumsum(src=g_s, dst=G_s, dim=0)
            tx = T.get_thread_binding()
            if tx < C:
                g_cum[ic, hv, tx] = G_s[tx]

            # ---- A = strict_lower(beta_i k_i.k_j exp(G_i - G_j))
            # Element-wise steps either only load shared memory (into a fragment) or only store
            # to it: a loop that does both reloads every operand after each store (the compiler
            # cannot rule out aliasing), one load latency per element.
            # With the L2 norm, k stays raw in its tile: |k_i|^2 is the diagonal of k k^T, and A
            # takes 1 / (|k_i| |k_j|) in fp32, with no pass that squares, reduces and rescales
            # the tile. One block per q/k head writes 1 / |q_i| (from the diagonal of q q^T the
            # same way) and 1 / |k_i| for chunk_fwd, which scales by them instead of reading
            # normalised copies.
            T.barrier_wait(loaded, 0)
            T.gemm(k_s, k_s, A_f, transpose_B=True, clear_accum=True)
            if l2:
                rnorm_from_diag(A_f, rk_s)
                if hv % ratio == 0:
                    T.gemm(q_s, q_s, P_f, transpose_B=True, clear_accum=True)
                    rnorm_from_diag(P_f, rq_s)
                    if tx < C:
                        qk_rnorm[ic, hk, 0, tx] = rq_s[tx]
                        qk_rnorm[ic, hk, 1, tx] = rk_s[tx]
            else:
                for i in T.Parallel(C):
                    rk_s[i] = 1.0
                if hv % ratio == 0:
                    if tx < C:  # chunk_fwd scales by the norms either way
                        qk_rnorm[ic, hk, 0, tx] = 1.0
                        qk_rnorm[ic, hk, 1, tx] = 1.0
            # Every factor of A_ij but k_i.k_j goes into one exponent, a row part and a column
            # part made once per row (64 threads): exp2(ea_i + eb_j) with
            # ea_i = G_i log2(e) + log2(beta_i / |k_i|) and eb_j = log2(1 / |k_j|) - G_j log2(e)
            # (beta_i = 0 gives -inf: a zero row). Three instructions per element (was nine).
            # Made for every element, with no mask: a masked product loaded its two exponents
            # per element (predicated loads are not shared between elements: ~190 shared-memory
            # wavefronts per block, a tenth of prep's), unmasked ones load a thread's two rows
            # and sixteen columns once. On and above the diagonal the exponent may overflow
            # (inf or NaN there): the substitution reads A only below the diagonal and N is
            # masked.
            if tx < C:
                ea_s[tx] = G_s[tx] * LOG2E + T.log2(b_s[tx] * rk_s[tx])
                eb_s[tx] = T.log2(rk_s[tx]) - G_s[tx] * LOG2E
            for i, j in T.Parallel(C, C):  # (A_f is the wgmma accumulator: written only by wgmma)
                M_f[i, j] = A_f[i, j] * T.exp2(ea_s[i] + eb_s[j])
            for i, j in T.Parallel(C, C):
                # only the diagonal blocks, which the substitution reads (a warp's rows are one
                # block row: the condition is uniform over each of its stores)
                if i // BLK == j // BLK:
                    A_s[i, j] = M_f[i, j]
                # N: the strictly block-lower part of A
                N_s[i, j] = T.cast(T.if_then_else(i // BLK > j // BLK, M_f[i, j], 0.0), MERGE_DTYPE)

            # ---- inverse of the 16x16 diagonal blocks of (I + A), forward substitution:
            # thread tx < 64 owns column tx % 16 of block tx // 16 and keeps it in registers,
            # so the 16 steps need no barrier.
            if tx < C:
                for s in T.unroll(BLK):
                    col[s] = T.if_then_else(tx % BLK == s, 1.0, 0.0)
                    for t in T.unroll(s):
                        col[s] = col[s] - A_s[(tx // BLK) * BLK + s, (tx // BLK) * BLK + t] * col[t]
                for s in T.unroll(BLK):
                    Dinv_s[(tx // BLK) * BLK + s, tx] = T.cast(col[s], MERGE_DTYPE)

            # ---- merge: (I + A) = D (I + P) with P = D^-1 N, N the strictly block-lower
            # part; P^4 = 0, so (I + A)^-1 = (I - P)(I + P^2) D^-1. Four 64x64x64 wgmma, each
            # clearing its accumulator; the element-wise steps only read it.
            # A left factor that is an earlier product stays in registers (an fp16 fragment in
            # the accumulator's layout is wgmma's register A operand): only right factors go to
            # shared memory, each from an fp16 fragment by one T.copy (stmatrix: four
            # instructions per thread, where element-wise stores took 32 two-byte ones): prep is
            # bound by its shared-memory pipe.
            T.gemm(Dinv_s, N_s, P_f, clear_accum=True)  # P
            for i, j in T.Parallel(C, C):
                Mh_f[i, j] = T.cast(P_f[i, j], MERGE_DTYPE)
                Mh2_f[i, j] = T.cast(T.if_then_else(i == j, 1.0, 0.0) - P_f[i, j], MERGE_DTYPE)
            T.copy(Mh_f, X_s)
            T.gemm(Mh_f, X_s, P_f, clear_accum=True)  # P^2
            for i, j in T.Parallel(C, C):
                Mh_f[i, j] = T.cast(T.if_then_else(i == j, 1.0, 0.0) + P_f[i, j], MERGE_DTYPE)
            T.copy(Mh_f, W_s)
            T.gemm(Mh2_f, W_s, P_f, clear_accum=True)  # R = (I - P)(I + P^2)
            for i, j in T.Parallel(C, C):
                Mh_f[i, j] = T.cast(P_f[i, j], MERGE_DTYPE)
            T.gemm(Mh_f, Dinv_s, P_f, clear_accum=True)  # T = R D^-1

            # ---- T diag(beta): v' = T diag(beta) (v - exp(G) k h) needs only this matrix
            # (rows past the chunk's end are zero: there k = 0 and beta = 0)
            # (one bulk store from shared memory instead of 32 two-byte stores per thread)
            for i, j in T.Parallel(C, C):
                Tb_f[i, j] = P_f[i, j] * b_s[j]
            T.copy(Tb_f, Tb_s)
            T.fence_proxy_async()
            T.sync_threads()
            T.tma_copy(Tb_s, t_beta[ic, hv, :, :])
            T.tma_store_wait()

    if packed:
        alog_dt, bias_dt = cfg.packed_inputs
        NA = T.dynamic("a_elems", "int64")
        NB = T.dynamic("b_elems", "int64")

        @T.prim_func
        def prep(
            qkv: T.Tensor((NT, QKV), dt),
            a: T.Tensor((NA,), dt),
            b: T.Tensor((NB,), dt),
            A_log: T.Tensor((HV,), alog_dt),
            dt_bias: T.Tensor((HV,), bias_dt),
            a_stride: T.int64,
            b_stride: T.int64,
            chunk_bounds: T.Tensor((NC, 2), "int32"),
            t_beta: T.Tensor((NC, HV, C, C), dt),
            g_cum: T.Tensor((NC, HV, C), f32),
            qk_rnorm: T.Tensor((NC, H, 2, C), f32),
        ):
            prep_body(qkv, qkv, a, b, A_log, dt_bias, a_stride, b_stride, chunk_bounds, t_beta, g_cum, qk_rnorm)

        return prep

    @T.prim_func
    def prep(
        q: T.Tensor((NT, H, K), dt),
        k: T.Tensor((NT, H, K), dt),
        g: T.Tensor((NT, HV), f32),
        beta: T.Tensor((NT, HV), bdt),
        chunk_bounds: T.Tensor((NC, 2), "int32"),
        t_beta: T.Tensor((NC, HV, C, C), dt),
        g_cum: T.Tensor((NC, HV, C), f32),
        qk_rnorm: T.Tensor((NC, H, 2, C), f32),
    ):
        prep_body(q, k, g, beta, None, None, None, None, chunk_bounds, t_beta, g_cum, qk_rnorm)

    return prep


def _fix_wgmma_accum_fence():
    """TileLang 0.1.15 sizes the register fence of a wgmma accumulator by the block's whole M:
    with M = 128 over two warpgroups (each its 64 rows) it fences twice the registers a thread
    holds, reads past the fragment, and ptxas moves the fragments to local memory and
    serialises every wgmma. Each warpgroup spans at most four warps' rows."""
    from tilelang.cuda.intrinsics.macro import wgmma_macro_generator as gen

    cls = gen.TensorCoreIntrinEmitter
    if getattr(cls, "_qla_fenced", False):
        return
    DataType = gen.DataType

    def wgmma_accum_regs(self) -> int:
        m_dim = min(self.block_row_warps, 4) * self.warp_row_tiles
        accum_bits = DataType(self.accum_dtype).bits
        return ((m_dim // 64) * self.warp_cols * self.local_size_out * accum_bits + 31) // 32

    cls.wgmma_accum_regs = property(wgmma_accum_regs)
    cls._qla_fenced = True


def _build_chunk_fwd(cfg: PrefillStaticConfig, nregs=(192, 104, 24)):
    """``chunk_fwd``: the serial pass, the state's products in registers, the chunk's other work beside it.

    Three roles, one block per (value head, work item), the whole V = 128 per block:

    * the state (two warpgroups, 256 threads): S (V x K, fp32) stays in the accumulator
      registers, its rows split between the two warpgroups (64 each), and every product of a
      chunk is taken transposed, with V as its M dimension, so that each result is the next
      product's A operand in registers: ``X = S k^T`` and ``S q^T`` from S's bf16 copy,
      ``v'^T = (v^T - X exp(G) / |k|) Tb^T`` (Tb = T diag(beta); one product, ``v^T`` taken
      into registers by ``ldmatrix .trans``), the output
      ``O^T = (S q^T) diag(exp(G) scale / |q|) + v'^T P^T``, the update
      ``S = exp(G_last) S + (v'^T exp(G_last - G) / |k|) k``. No copy of the state or of ``v'``
      goes through shared memory and no other role waits for them: the chain between two
      chunks is three products of this role. Its two warpgroups take turns issuing the first
      products (named barriers), so that one's element-wise steps overlap the other's products.
    * P (one warpgroup): ``P = mask(q k^T exp(G_i - G_j)) scale / (|q_i| |k_j|)`` and the
      chunk's per-token factors, into a per-stage buffer, up to two chunks ahead of the state.
    * the producer (one warpgroup): copies chunk c + 1's q, k, v, ``T diag(beta)``, gates and
      norms into the other stage by TMA while the others work on chunk c.

    mbarriers order the hand-offs (one phase per chunk and stage; one arrival per warp). A full
    chunk's output leaves during the next chunk's first products: ``stmatrix .trans`` into a
    shared tile, one TMA store per warpgroup (its 64 columns); a partial last chunk by masked
    stores. TileLang's automatic barrier placement is off for this kernel (``_kernel_set``):
    the barriers are written here.
    """
    import tilelang.language as T
    from tilelang.cuda.language import pdl_sync
    from tilelang.layout import Fragment, make_swizzled_layout

    _fix_wgmma_accum_fence()
    H, HV, K, V, C = cfg.num_qk_heads, cfg.num_v_heads, HEAD_DIM, HEAD_DIM, CHUNK
    ratio = HV // H
    dt, pdt, f32 = cfg.dtype, cfg.pool_dtype, "float32"
    NT = T.dynamic("num_tokens", "int64")
    NW = T.dynamic("num_work_items")
    NC = T.dynamic("num_chunks", "int64")
    NS = T.dynamic("num_seqs")
    NS1 = T.dynamic("num_seqs_plus_one")
    NP = T.dynamic("pool_elems", "int64")
    NP0 = T.dynamic("h0_pool_elems", "int64")
    NCK = T.dynamic("num_ckpt_rows", "int64")
    packed = cfg.packed_inputs is not None
    # packed inputs: q, k and v are one buffer, the engine's conv output (its q, k, v columns)
    QK_SHAPE = (NT, (2 * H + HV) * K) if packed else (NT, H, K)
    V_SHAPE = QK_SHAPE if packed else (NT, HV, V)
    WG = 128
    NREG_STATE, NREG_P, NREG_PRODUCER = nregs
    # Each thread starts with 64K / 512 = 128 registers. setmaxnreg.inc below the current count
    # (or .dec above it) is an illegal instruction on the device, so the direction follows the
    # budget, and a role that keeps 128 issues nothing.
    NREG_LAUNCH = 65536 // (4 * WG)
    if (2 * NREG_STATE + NREG_P + NREG_PRODUCER) * WG > 65536 or any(r % 8 or not 24 <= r <= 256 for r in nregs):
        raise ValueError(f"fwd_role_nregs {nregs}: each a multiple of 8 in [24, 256], 2 x state + P + producer <= 512")
    BAR_STATE, TURN = 2, 4  # named barriers: 2, 3 each state warpgroup's; 4, 5 their turns (0 is __syncthreads)
    SET_STATE, SET_P, SET_PRODUCER = (r != NREG_LAUNCH for r in nregs)
    INC_STATE, INC_P, INC_PRODUCER = (int(r > NREG_LAUNCH) for r in nregs)
    ROWS = T.GemmWarpPolicy.FullRow  # the state role's products: each warpgroup its 64 rows of V

    @T.macro
    def out_tile_store(o_s, ob_f, tx, wg):
        # The transposed output (V x chunk, in the accumulators' layout) to o_s (chunk x V) by
        # stmatrix .trans: per 8 x 8 tile a thread holds two tokens of one row of V (rows
        # lane / 4, tokens 2 (lane % 4) + 0, 1); stored transposed, a token's 8 values of V are
        # its row's 16 bytes. Four instructions per thread where element-wise stores took 32.
        # Instruction m stores the tiles q = 0..3 of token block 2 m + q // 2 and half q % 2
        # of the thread's warp's 16 rows of V; lanes 8 q .. 8 q + 7 address tile q's rows.
        lane = tx % 32
        v0 = wg * 64 + ((tx % WG) // 32) * 16 + lane // 4  # the thread's row of V in tile half 0
        t0 = (lane % 4) * 2  # its first token in a block
        for m in T.unroll(4):
            T.call_extern(
                "handle", "tl::ptx_stmatrix_m8n8_x4_trans",
                T.address_of(o_s[(2 * m + lane // 16) * 8 + lane % 8,
                                 wg * 64 + ((tx % WG) // 32) * 16 + ((lane // 8) % 2) * 8]),
                T.call_extern("uint32", "__pack_half2", ob_f[v0, 16 * m + t0], ob_f[v0, 16 * m + t0 + 1]),
                T.call_extern("uint32", "__pack_half2", ob_f[v0 + 8, 16 * m + t0], ob_f[v0 + 8, 16 * m + t0 + 1]),
                T.call_extern("uint32", "__pack_half2", ob_f[v0, 16 * m + 8 + t0], ob_f[v0, 16 * m + 8 + t0 + 1]),
                T.call_extern("uint32", "__pack_half2", ob_f[v0 + 8, 16 * m + 8 + t0],
                              ob_f[v0 + 8, 16 * m + 8 + t0 + 1]))

    @T.macro
    def v_tile_load(vt_f, v_s, st, tx, wg):
        # v^T of the warpgroup's 64 rows of V (chunk x V in v_s) into vt_f, in the accumulators'
        # layout, by ldmatrix .trans: per 8 x 8 tile (tokens x V) a thread gets one row of V and
        # two tokens, as the accumulator holds them. Instruction m loads token blocks 2 m and
        # 2 m + 1, each for the warp's two 8-row halves of V: lanes 8 q .. 8 q + 7 address tile
        # q's eight token rows (16 bytes of V each), and the four results are the thread's
        # values 8 m .. 8 m + 7.
        lane = tx % 32
        q4 = lane // 8
        for m in T.unroll(4):
            T.call_extern(
                "handle", "tl::ptx_ldmatrix_x4_trans",
                T.address_of(v_s[st, (2 * m + q4 // 2) * 8 + lane % 8, wg * 64 + ((tx % WG) // 32) * 16 + (q4 % 2) * 8]),
                T.address_of(vt_f[wg * 64 + ((tx % WG) // 32) * 16 + lane // 4, 16 * m + (lane % 4) * 2]))

    @T.macro
    def out_bulk_store(o_s, ob_f, o, row, hv, tx, wg):
        # A full chunk's output (rows row .. row + 63 of o): each state warpgroup puts its 64
        # columns in o_s and stores them by TMA on its own (no barrier between the two)
        T.tma_store_wait()  # the bulk store before it has read o_s (its issuing thread)
        T.sync_threads(BAR_STATE + wg, WG)
        out_tile_store(o_s, ob_f, tx, wg)
        T.fence_proxy_async()
        T.sync_threads(BAR_STATE + wg, WG)  # o_s written
        if tx < WG:
            T.tma_copy(o_s[:, 0 : V // 2], o[row : row + C, hv, 0 : V // 2])
        else:
            T.tma_copy(o_s[:, V // 2 : V], o[row : row + C, hv, V // 2 : V])

    @T.macro
    def load_start_state(S_f, Sp_f, h0_pool, h0_slots, h0_slot_stride, n, hv):
        # sequence n's start state for value head hv, fp32 into the state's accumulators; a 16-bit
        # pool goes through a fragment of its dtype (Sp_f): loaded and widened in one step, it
        # made ptxas keep part of the state in local memory through every chunk of the loop
        if pdt == f32:
            for i, d in T.Parallel(V, K):
                S_f[i, d] = T.cast(h0_pool[T.cast(h0_slots[n], "int64") * h0_slot_stride + hv * (V * K) + i * K + d], f32)
        else:
            for i, d in T.Parallel(V, K):
                Sp_f[i, d] = h0_pool[T.cast(h0_slots[n], "int64") * h0_slot_stride + hv * (V * K) + i * K + d]
            for i, d in T.Parallel(V, K):
                S_f[i, d] = T.cast(Sp_f[i, d], f32)

    @T.prim_func
    def chunk_fwd(
        q: T.Tensor(QK_SHAPE, dt),
        k: T.Tensor(QK_SHAPE, dt),
        v: T.Tensor(V_SHAPE, dt),
        t_beta: T.Tensor((NC, HV, C, C), dt),
        g_cum: T.Tensor((NC, HV, C), f32),
        qk_rnorm: T.Tensor((NC, H, 2, C), f32),
        cu_seqlens: T.Tensor((NS1,), "int32"),
        chunk_offsets: T.Tensor((NS1,), "int32"),
        work_items: T.Tensor((NW, 4), "int32"),
        ckpt_offsets: T.Tensor((NS1,), "int32"),
        has_initial_state: T.Tensor((NS,), "uint8"),
        h0_slots: T.Tensor((NS,), "int32"),
        h0_pool: T.Tensor((NP0,), pdt),
        h0_slot_stride: T.int64,
        state_indices: T.Tensor((NS,), "int32"),
        pool: T.Tensor((NP,), pdt),
        slot_stride: T.int64,
        ckpt_every_chunks: T.int32,
        checkpoints: T.Tensor((NCK, HV, V, K), pdt),
        warmup_log_threshold: T.float32,
        scale: T.float32,
        o: T.Tensor((NT, HV, V), dt),
    ):
        with T.Kernel(1, HV, NW, threads=4 * WG) as (_, hv, wi):
            hk = hv // ratio
            n = work_items[wi, 0]
            out_chunk = work_items[wi, 2]
            end_chunk = work_items[wi, 3]
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            row0 = chunk_offsets[n]

            q_s = T.alloc_shared((2, C, K), dt)
            k_s = T.alloc_shared((2, C, K), dt)
            v_s = T.alloc_shared((2, C, V), dt)
            t_s = T.alloc_shared((2, C, C), dt)
            g_s = T.alloc_shared((2, C), f32)
            # 1 / |q_i| and 1 / |k_i| per stage (prep's; ones without the L2 norm): q and k arrive raw
            rn_s = T.alloc_shared((2, 2, C), f32)
            p_s = T.alloc_shared((2, C, C), dt)  # P per stage (the P role's)
            # per stage, per token j (the P role's): -exp(G_j) / |k_j|, exp(G_last - G_j) / |k_j|
            # (0 past the chunk's end), exp(G_j) scale / |q_j|
            fac_s = T.alloc_shared((2, 3, C), f32)
            o_s = T.alloc_shared((C, V), dt)  # a full chunk's output, for the bulk store
            # written by stmatrix .trans, eight tokens' 16-byte rows per tile: swizzled, so that
            # those rows do not share banks
            # v_s likewise (read by ldmatrix .trans, eight tokens' 16-byte rows per tile)
            T.annotate_layout({o_s: make_swizzled_layout(o_s), v_s: make_swizzled_layout(v_s)})
            S_f = T.alloc_fragment((V, K), f32)
            Sb_f = T.alloc_fragment((V, K), dt)
            Sp_f = Sb_f if pdt in (dt, f32) else T.alloc_fragment((V, K), pdt)  # the start state's 16-bit copy
            x_f = T.alloc_fragment((V, C), f32)
            u_f = T.alloc_fragment((V, C), f32)
            o_f = T.alloc_fragment((V, C), f32)
            xb_f = T.alloc_fragment((V, C), dt)
            vb_f = T.alloc_fragment((V, C), dt)
            ub_f = T.alloc_fragment((V, C), dt)
            ob_f = T.alloc_fragment((V, C), dt)
            vt_f = T.alloc_fragment((V, C), dt)  # v^T (ldmatrix .trans from v_s)
            # the accumulators' layout (wgmma m64 per warpgroup, FullRow over the two), given
            # here because out_tile_store and v_tile_load address a thread's values by their indices
            acc_layout = Fragment(
                [V, C], forward_thread_fn=lambda i, j: (i // 64) * 128 + ((i % 64) // 16) * 32 + (i % 8) * 4 + (j % 8) // 2,
                forward_index_fn=lambda i, j: (j // 8) * 4 + ((i % 16) // 8) * 2 + j % 2)
            T.annotate_layout({ob_f: acc_layout, vt_f: acc_layout})
            p_f = T.alloc_fragment((C, C), f32)
            pb_f = T.alloc_fragment((C, C), dt)
            first = T.alloc_var("int32")
            decay = T.alloc_var(f32)
            g_last = T.alloc_var(f32)
            ck_row = T.alloc_var("int32")

            full = T.alloc_barrier([WG, WG])  # stage filled (producer)
            # one arrival per warp on these three
            empty = T.alloc_barrier([12, 12])  # stage consumed (state role's 8 warps, P role's 4)
            p_ready = T.alloc_barrier([4, 4])  # P and the factors of a stage written (P role)
            p_free = T.alloc_barrier([8, 8])  # ... and read (state role)

            # AutoCP: a work item starting after its sequence's first chunk begins from a zero
            # state and replays the warm-up chunks [first, out_chunk) without output. Where this
            # head's gate did not decay below the threshold over that window, the warm-up would
            # not be exact enough: the item replays from the sequence start instead (exact).
            first = work_items[wi, 1]
            tx = T.get_thread_binding()
            # The state role reads its start state before waiting on prep: the pool (or AutoCP's
            # snapshot of it) is not prep's output, and the load overlaps prep's last blocks.
            if tx < 2 * WG:
                if first == 0 and has_initial_state[n] != 0:
                    load_start_state(S_f, Sp_f, h0_pool, h0_slots, h0_slot_stride, n, hv)
                else:
                    T.clear(S_f)
            # prep's outputs (g_cum here, the producer's loads below) only after prep is done:
            # this kernel is launched as prep's programmatic dependent, so it may be resident
            # while prep's last blocks run
            pdl_sync()
            if first > 0:
                decay = 0.0
                # four chunks' loads in flight at once (this is on every warm-up item's path
                # to its first chunk)
                for c4 in T.serial(T.ceildiv(out_chunk - first, 4)):
                    for u in T.unroll(4):
                        if c4 * 4 + u < out_chunk - first:
                            decay = decay + g_cum[row0 + first + c4 * 4 + u, hv, C - 1]
                if decay > warmup_log_threshold:
                    first = 0
            nchunks = end_chunk - first
            # The roles' chunk loops, twice each (a Python loop, expanded when the kernel is
            # built): the warm-up chunks of an AutoCP item (before its first output chunk) take
            # only the state's chain (no S q^T, no P, no v'^T P^T, nothing stored), the output
            # chunks everything. One loop with the output steps under a branch would not do:
            # ptxas serialises every wgmma of the kernel when an accumulator's definition is
            # conditional.
            nwarm = out_chunk - first
            CHUNK_LOOPS = ((False, 0, nwarm), (True, nwarm, nchunks))

            if tx < 2 * WG:
                # ---------------- the state (two warpgroups)
                if SET_STATE:
                    T.set_max_nreg(NREG_STATE, INC_STATE)
                base = T.cast(state_indices[n], "int64") * slot_stride + hv * (V * K)
                if first == 0 and work_items[wi, 1] > 0 and has_initial_state[n] != 0:
                    # an AutoCP item whose head replays from the sequence start (above)
                    load_start_state(S_f, Sp_f, h0_pool, h0_slots, h0_slot_stride, n, hv)
                # The two warpgroups take turns issuing their products (each its half of V):
                # while one's run on the tensor cores, the other does its element-wise steps.
                # A turn is a named barrier the waiting warpgroup syncs on and the other arrives
                # at once it has issued; warpgroup 1 lets warpgroup 0 go first.
                wg = tx // WG
                if wg == 1:
                    T.named_barrier_arrive(TURN, 2 * WG)
                for with_output, c_begin, c_end in CHUNK_LOOPS:
                    for c in T.serial(c_begin, c_end):
                        st = c % 2
                        ci = first + c
                        cs = bos + ci * C
                        L = T.min(eos - cs, C)
                        T.barrier_wait(full[st], (c // 2) % 2)
                        # both products of the state's bf16 copy at once (its registers stay live
                        # until both are done: waiting for S k^T alone, with S q^T still running,
                        # left ptxas without the registers and it serialised every wgmma)
                        for i, d in T.Parallel(V, K):
                            Sb_f[i, d] = T.cast(S_f[i, d], dt)
                        T.sync_threads(TURN + wg, 2 * WG)
                        T.wgmma_gemm(Sb_f, k_s[st, :, :], x_f, transpose_B=True, policy=ROWS, clear_accum=True)
                        if with_output:
                            T.wgmma_gemm(Sb_f, q_s[st, :, :], o_f, transpose_B=True, policy=ROWS, clear_accum=True)
                        T.named_barrier_arrive(TURN + 1 - wg, 2 * WG)
                        if with_output:
                            # the last chunk's output leaves while the tensor cores work (a chunk
                            # before the item's last is a full one)
                            if ci > out_chunk:
                                out_bulk_store(o_s, ob_f, o, cs - C, hv, tx, wg)
                        T.barrier_wait(p_ready[st], (c // 2) % 2)
                        T.wait_wgmma(0)
                        v_tile_load(vt_f, v_s, st, tx, wg)
                        for i, j in T.Parallel(V, C):
                            xb_f[i, j] = T.cast(x_f[i, j] * fac_s[st, 0, j] + T.cast(vt_f[i, j], f32), dt)
                        # v'^T = (v^T + xb) Tb^T, one product (v^T taken into registers above; two
                        # products, v^T Tb^T from shared memory, cost a second one per chunk); the
                        # decays of S and of S q^T meanwhile
                        T.sync_threads(TURN + wg, 2 * WG)
                        T.wgmma_gemm(xb_f, t_s[st, :, :], u_f, transpose_B=True, policy=ROWS, clear_accum=True)
                        T.named_barrier_arrive(TURN + 1 - wg, 2 * WG)
                        g_last = T.exp2(g_s[st, L - 1] * LOG2E)  # the state's decay over the chunk
                        for i, d in T.Parallel(V, K):
                            S_f[i, d] = S_f[i, d] * g_last
                        if with_output:
                            for i, j in T.Parallel(V, C):
                                o_f[i, j] = o_f[i, j] * fac_s[st, 2, j]
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(V, C):
                            ub_f[i, j] = T.cast(u_f[i, j] * fac_s[st, 1, j], dt)
                            if with_output:
                                vb_f[i, j] = T.cast(u_f[i, j], dt)
                        T.sync_threads(TURN + wg, 2 * WG)
                        T.wgmma_gemm(ub_f, k_s[st, :, :], S_f, policy=ROWS)
                        if with_output:
                            T.wgmma_gemm(vb_f, p_s[st, :, :], o_f, transpose_B=True, policy=ROWS)
                        T.named_barrier_arrive(TURN + 1 - wg, 2 * WG)
                        T.wait_wgmma(0)
                        # P, the factors and the stage's tiles all read: one arrival per warp
                        T.sync_warp()
                        if tx % 32 == 0:
                            T.barrier_arrive(p_free[st])
                            T.barrier_arrive(empty[st])
                        if with_output:
                            for i, j in T.Parallel(V, C):
                                ob_f[i, j] = T.cast(o_f[i, j], dt)
                            if ckpt_every_chunks > 0:
                                if L == C and (ci + 1) % ckpt_every_chunks == 0:
                                    # a variable, not an expression: TileLang inlines a plain binding into
                                    # every element's address (a global load and an int64 division each)
                                    ck_row = ckpt_offsets[n] + (ci + 1) // ckpt_every_chunks - 1
                                    for i, d in T.Parallel(V, K):
                                        checkpoints[ck_row, hv, i, d] = S_f[i, d]
                # the item's last chunk's output (full or partial)
                if end_chunk > out_chunk:
                    cs = bos + (end_chunk - 1) * C
                    L = T.min(eos - cs, C)
                    if L == C:
                        out_bulk_store(o_s, ob_f, o, cs, hv, tx, wg)
                    else:
                        for i, j in T.Parallel(V, C):
                            if j < L:
                                o[cs + j, hv, i] = ob_f[i, j]
                T.tma_store_wait()
                if end_chunk == T.ceildiv(eos - bos, C):
                    for i, d in T.Parallel(V, K):
                        pool[base + i * K + d] = S_f[i, d]
            elif tx < 3 * WG:
                # ---------------- P and the per-token factors
                if SET_P:
                    T.set_max_nreg(NREG_P, INC_P)
                for with_output, c_begin, c_end in CHUNK_LOOPS:
                    for c in T.serial(c_begin, c_end):
                        st = c % 2
                        ci = first + c
                        L = T.min(eos - (bos + ci * C), C)
                        T.barrier_wait(full[st], (c // 2) % 2)
                        T.barrier_wait(p_free[st], ((c // 2) % 2) ^ 1)
                        if with_output:
                            # q k^T on the tensor cores while the factors are made (below)
                            T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
                        j = tx - 2 * WG
                        if j < C:
                            fac_s[st, 0, j] = -T.exp2(g_s[st, j] * LOG2E) * rn_s[st, 1, j]
                            fac_s[st, 1, j] = T.if_then_else(
                                j < L, T.exp2((g_s[st, L - 1] - g_s[st, j]) * LOG2E), 0.0) * rn_s[st, 1, j]
                            if with_output:
                                fac_s[st, 2, j] = T.exp2(g_s[st, j] * LOG2E) * (scale * rn_s[st, 0, j])
                        if with_output:
                            T.wait_wgmma(0)
                            # Branch-free, so that the gate loads issue together: masked entries take
                            # p = 0 and a clamped exponent (G_i - G_j <= 0 where i >= j; elsewhere it
                            # could overflow, and inf * 0 is NaN).
                            # (rows scaled by scale / |q_i|, the output's factor)
                            for i, j in T.Parallel(C, C):
                                pb_f[i, j] = T.if_then_else(T.And(i >= j, j < L), p_f[i, j], 0.0) * T.exp2(
                                    T.min(g_s[st, i] - g_s[st, j], 0.0) * LOG2E) * (rn_s[st, 1, j] * (scale * rn_s[st, 0, i]))
                            T.copy(pb_f, p_s[st, :, :])
                        T.fence_proxy_async()
                        # one arrival per warp (each warp's reads and writes done first)
                        T.sync_warp()
                        if tx % 32 == 0:
                            T.barrier_arrive(p_ready[st])
                            T.barrier_arrive(empty[st])
            else:
                # ---------------- the producer
                if SET_PRODUCER:
                    T.set_max_nreg(NREG_PRODUCER, INC_PRODUCER)
                for c in T.serial(nchunks):
                    st = c % 2
                    cs = bos + (first + c) * C
                    T.barrier_wait(empty[st], ((c // 2) % 2) ^ 1)
                    # TMA loads that arrive on full[st] with their byte counts
                    if packed:
                        T.tma_copy(q[cs : cs + C, hk * K : (hk + 1) * K], q_s[st, :, :], barrier=full[st])
                        T.tma_copy(k[cs : cs + C, (H + hk) * K : (H + hk + 1) * K], k_s[st, :, :], barrier=full[st])
                        T.tma_copy(v[cs : cs + C, 2 * H * K + hv * V : 2 * H * K + (hv + 1) * V], v_s[st, :, :],
                                   barrier=full[st])
                    else:
                        T.tma_copy(q[cs : cs + C, hk, :], q_s[st, :, :], barrier=full[st])
                        T.tma_copy(k[cs : cs + C, hk, :], k_s[st, :, :], barrier=full[st])
                        T.tma_copy(v[cs : cs + C, hv, :], v_s[st, :, :], barrier=full[st])
                    T.tma_copy(t_beta[row0 + first + c, hv, :, :], t_s[st, :, :], barrier=full[st])
                    T.tma_copy(g_cum[row0 + first + c, hv, :], g_s[st, :], barrier=full[st])
                    T.tma_copy(qk_rnorm[row0 + first + c, hk, :, :], rn_s[st, :, :], barrier=full[st])
                    T.barrier_arrive(full[st])

    return chunk_fwd


# --------------------------------------------------------------------------------------
# Compilation and cache (the cache, and what loads a library's kernels instead, in chunk_prefill.py)
# --------------------------------------------------------------------------------------


def _compile_set(cfg: PrefillStaticConfig, tilelang):
    """``cfg``'s two kernels (``prep``, ``chunk_fwd``) compiled with ``tilelang`` (the module), as
    the library build compiles them."""
    tune = PREFILL_CONFIGS
    target, pc = _target(), _pass_configs()
    # prep with nvcc's fast math (one MUFU per exp2/rsqrt, no denormal fix-ups); chunk_fwd
    # gained nothing from it and keeps exact math
    prep = tilelang.compile(_build_prep(cfg, tune["prep_threads"], tune["prep_min_blocks"], tune["prep_a_row_pad"]),
                            target=target, pass_configs=_pass_configs(fast_math=True))
    # chunk_fwd places its own warpgroup barriers (see _build_chunk_fwd)
    fwd_pc = dict(pc, **{tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})
    # denormals flushed (-ftz): exp2 is one MUFU instead of four instructions with its range
    # fix-up (P's mask pass makes 32 per thread and chunk, on SMSPs it shares with the state)
    fwd = tilelang.compile(_build_chunk_fwd(cfg, tuple(tune["fwd_role_nregs"])), target=target, pass_configs=fwd_pc,
                           compile_flags=["-ftz=true"])
    return prep, fwd
