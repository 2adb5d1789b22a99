"""Chunked gated-delta-rule prefill forward for SM90, in TileLang.

The math is ``docs/design.md``'s chunked form with 64-token chunks. Three kernels, each
compiled once per static configuration (head counts, dtypes, pool dtype, flags); the
token count, the number of sequences and their lengths are runtime values read from the
plan's device tables, so a new batch composition compiles nothing and syncs nothing.

* ``prep``  — grid (chunk, value head): gate cumsum inside the chunk, optional q/k L2 norm
  of k, ``A = strict_lower(beta k k^T exp(G_i - G_j))``, ``T = (I + A)^-1`` (16x16 diagonal
  blocks by forward substitution in registers, merged with four tf32 products), then
  ``w = T (beta exp(G) k)`` and ``u = T (beta v)``. Fully parallel over chunks.
* ``state`` — grid (V slice, value head, sequence): the serial chunk-to-chunk pass. TileLang
  warp-specializes it: a TMA producer warpgroup double-buffers the next chunk's w, k and u
  while the consumer warpgroup runs the two wgmma products and the gating. Reads the
  initial state straight from the engine's pool, writes each chunk's entering
  state ``h`` and ``v' = u - w h`` to workspaces, checkpoints at the plan's chunk
  boundaries and the final state back into the pool in place. The state rows (V) are
  independent, so V is split across blocks for parallelism.
* ``output`` — grid (chunk, value head): ``o = scale ((q exp(G)) h + lower_incl(q k^T
  exp(G_i - G_j)) v')``. Fully parallel over chunks.

Sub-sequences (AutoCP): ``state`` only needs, per sequence, its token range, its first chunk
row and a start state; cutting a sequence into pieces with their own start states is a
matter of the tables it is given, the kernel is unchanged.

The bf16/fp16 matrix products are ``T.gemm`` on 64-row tiles with one warpgroup of 128
threads, lowered to wgmma (HGMMA in the SASS: prep 16, state 12, output 20 per kernel); the
four 64x64 tf32 products of the triangular merge run on mma.sync (HMMA), as TileLang 0.1.15
lowers fp32 operands.
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel signatures' annotations.

import threading
from dataclasses import dataclass

import torch

from .configs import PREFILL_CONFIGS

CHUNK = 64
HEAD_DIM = 128
L2NORM_EPS = 1e-6

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

_lock = threading.Lock()
_kernels: dict = {}
_compile_count = 0


def compile_count() -> int:
    """Number of static configurations built in this process (each one is three kernels)."""
    return _compile_count


@dataclass(frozen=True)
class PrefillStaticConfig:
    """Everything a compiled prefill kernel set depends on; all else is a runtime value."""

    num_qk_heads: int
    num_v_heads: int
    dtype: str  # activations q, k, v, o: "bfloat16" | "float16"
    beta_dtype: str  # "float32" or the activation dtype
    pool_dtype: str  # state pool and checkpoints: "float32" | "bfloat16"
    use_qk_l2norm: bool


def _target():
    from tvm.target import Target

    # sm_90a explicitly: wgmma needs the arch-specific target; this also compiles without a GPU.
    return Target({"kind": "cuda", "arch": "sm_90a"})


def _pass_configs():
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}


# --------------------------------------------------------------------------------------
# Kernel builders
# --------------------------------------------------------------------------------------


def _build_prep(cfg: PrefillStaticConfig, threads: int):
    import tilelang.language as T

    H, HV, K, V, C = cfg.num_qk_heads, cfg.num_v_heads, HEAD_DIM, HEAD_DIM, CHUNK
    ratio = HV // H
    dt, bdt, f32 = cfg.dtype, cfg.beta_dtype, "float32"
    l2 = cfg.use_qk_l2norm
    NT = T.dynamic("num_tokens", "int64")
    NC = T.dynamic("num_chunks", "int64")
    NS1 = T.dynamic("num_seqs_plus_one")
    BLK = 16  # diagonal block size of the triangular solve

    @T.prim_func
    def prep(
        k: T.Tensor((NT, H, K), dt),
        v: T.Tensor((NT, HV, V), dt),
        g: T.Tensor((NT, HV), f32),
        beta: T.Tensor((NT, HV), bdt),
        cu_seqlens: T.Tensor((NS1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        w: T.Tensor((NT, HV, K), dt),
        u: T.Tensor((NT, HV, V), dt),
        g_cum: T.Tensor((NT, HV), f32),
        k_normed: T.Tensor((NT, H, K), dt),
    ):
        with T.Kernel(NC, HV, threads=threads) as (ic, hv):
            hk = hv // ratio
            seq = chunk_indices[ic, 0]
            bos = cu_seqlens[seq] + chunk_indices[ic, 1] * C
            L = T.min(cu_seqlens[seq + 1] - bos, C)

            k_f = T.alloc_fragment((C, K), f32)
            sq = T.alloc_fragment((C,), f32)
            k_s = T.alloc_shared((C, K), dt)
            kb_s = T.alloc_shared((C, K), dt)
            vb_s = T.alloc_shared((C, V), dt)
            g_s = T.alloc_shared((C,), f32)
            G_s = T.alloc_shared((C,), f32)
            b_s = T.alloc_shared((C,), f32)
            A_f = T.alloc_fragment((C, C), f32)
            A_s = T.alloc_shared((C, C), f32)  # strict lower A, fp32
            Dinv_s = T.alloc_shared((C, C), f32)  # inverse of the 16x16 diagonal blocks
            Bt_s = T.alloc_shared((C, C), f32)  # a right-hand operand, stored transposed (K-major)
            X_s = T.alloc_shared((C, C), f32)  # a left-hand operand
            P_f = T.alloc_fragment((C, C), f32)
            Q_f = T.alloc_fragment((C, C), f32)
            Tm_s = T.alloc_shared((C, C), dt)
            col = T.alloc_local((BLK,), f32)
            wk_f = T.alloc_fragment((C, K), f32)
            uv_f = T.alloc_fragment((C, V), f32)

            # ---- loads, zero past the chunk's end (exactly the reference's padding)
            for i, d in T.Parallel(C, K):
                k_f[i, d] = T.if_then_else(i < L, T.cast(k[bos + i, hk, d], f32), 0.0)
            for i in T.Parallel(C):
                g_s[i] = T.if_then_else(i < L, g[bos + i, hv], 0.0)
                b_s[i] = T.if_then_else(i < L, T.cast(beta[bos + i, hv], f32), 0.0)
            if l2:
                for i, d in T.Parallel(C, K):
                    wk_f[i, d] = k_f[i, d] * k_f[i, d]
                T.reduce_sum(wk_f, sq, dim=1)
                for i, d in T.Parallel(C, K):
                    k_f[i, d] = k_f[i, d] * T.rsqrt(sq[i] + L2NORM_EPS)
            T.copy(k_f, k_s)
            if l2:
                if hv % ratio == 0:
                    for i, d in T.Parallel(C, K):
                        if i < L:
                            k_normed[bos + i, hk, d] = k_s[i, d]
            # inclusive cumsum of the gate inside the chunk (64 terms; cheap, exact order)
            for i in T.Parallel(C):
                G_s[i] = 0.0
                for j in T.serial(C):
                    if j <= i:
                        G_s[i] = G_s[i] + g_s[j]
            for i in T.Parallel(C):
                if i < L:
                    g_cum[bos + i, hv] = G_s[i]

            # ---- A = strict_lower(beta_i k_i.k_j exp(G_i - G_j))
            T.gemm(k_s, k_s, A_f, transpose_B=True, clear_accum=True)
            for i, j in T.Parallel(C, C):
                A_s[i, j] = T.if_then_else(i > j, A_f[i, j] * b_s[i] * T.exp(G_s[i] - G_s[j]), 0.0)

            # ---- inverse of the 16x16 diagonal blocks of (I + A), forward substitution:
            # thread tx < 64 owns column tx % 16 of block tx // 16 and keeps it in registers,
            # so the 16 steps need no barrier.
            for i, j in T.Parallel(C, C):
                Dinv_s[i, j] = 0.0
            tx = T.get_thread_binding()
            if tx < C:
                for s in T.unroll(BLK):
                    col[s] = T.if_then_else(tx % BLK == s, 1.0, 0.0)
                    for t in T.unroll(s):
                        col[s] = col[s] - A_s[(tx // BLK) * BLK + s, (tx // BLK) * BLK + t] * col[t]
                for s in T.unroll(BLK):
                    Dinv_s[(tx // BLK) * BLK + s, tx] = col[s]

            # ---- merge: (I + A) = D (I + P) with P = D^-1 N, N the strictly block-lower
            # part; P^4 = 0, so (I + A)^-1 = (I - P)(I + P^2) D^-1.
            for i, j in T.Parallel(C, C):  # Bt = N^T
                Bt_s[j, i] = T.if_then_else(i // BLK > j // BLK, A_s[i, j], 0.0)
            T.gemm(Dinv_s, Bt_s, P_f, transpose_B=True, clear_accum=True)  # P
            for i, j in T.Parallel(C, C):
                X_s[i, j] = P_f[i, j]
                Bt_s[j, i] = P_f[i, j]
            T.gemm(X_s, Bt_s, Q_f, transpose_B=True, clear_accum=True)  # P^2
            for i, j in T.Parallel(C, C):
                Bt_s[j, i] = Q_f[i, j]
            for i, j in T.Parallel(C, C):  # Q = I - P
                Q_f[i, j] = T.if_then_else(i == j, 1.0, 0.0) - P_f[i, j]
            for i, j in T.Parallel(C, C):
                X_s[i, j] = Q_f[i, j]
            T.gemm(X_s, Bt_s, Q_f, transpose_B=True)  # R = Q + Q P^2
            for i, j in T.Parallel(C, C):
                X_s[i, j] = Q_f[i, j]
                Bt_s[j, i] = Dinv_s[i, j]
            T.gemm(X_s, Bt_s, P_f, transpose_B=True, clear_accum=True)  # T = R D^-1
            T.copy(P_f, Tm_s)

            # ---- w = T (beta exp(G) k), u = T (beta v)
            for i, d in T.Parallel(C, K):
                kb_s[i, d] = k_f[i, d] * b_s[i] * T.exp(G_s[i])
            for i, d in T.Parallel(C, V):
                vb_s[i, d] = T.if_then_else(i < L, T.cast(v[bos + i, hv, d], f32) * b_s[i], 0.0)
            T.gemm(Tm_s, kb_s, wk_f, clear_accum=True)
            T.gemm(Tm_s, vb_s, uv_f, clear_accum=True)
            for i, d in T.Parallel(C, K):
                if i < L:
                    w[bos + i, hv, d] = wk_f[i, d]
            for i, d in T.Parallel(C, V):
                if i < L:
                    u[bos + i, hv, d] = uv_f[i, d]

    return prep


def _build_state(cfg: PrefillStaticConfig, block_v: int, threads: int, num_stages: int):
    import tilelang.language as T

    H, HV, K, V, C = cfg.num_qk_heads, cfg.num_v_heads, HEAD_DIM, HEAD_DIM, CHUNK
    ratio = HV // H
    dt, pdt, f32 = cfg.dtype, cfg.pool_dtype, "float32"
    BV = block_v
    NT = T.dynamic("num_tokens", "int64")
    NC = T.dynamic("num_chunks", "int64")
    NS = T.dynamic("num_seqs")
    NS1 = T.dynamic("num_seqs_plus_one")
    NP = T.dynamic("pool_elems", "int64")
    NCK = T.dynamic("num_ckpt_rows", "int64")

    @T.prim_func
    def state(
        w: T.Tensor((NT, HV, K), dt),
        u: T.Tensor((NT, HV, V), dt),
        k_normed: T.Tensor((NT, H, K), dt),
        g_cum: T.Tensor((NT, HV), f32),
        cu_seqlens: T.Tensor((NS1,), "int32"),
        chunk_offsets: T.Tensor((NS1,), "int32"),
        ckpt_offsets: T.Tensor((NS1,), "int32"),
        state_indices: T.Tensor((NS,), "int32"),
        has_initial_state: T.Tensor((NS,), "uint8"),
        pool: T.Tensor((NP,), pdt),
        slot_stride: T.int64,
        ckpt_every_chunks: T.int32,
        checkpoints: T.Tensor((NCK, HV, V, K), pdt),
        h_chunks: T.Tensor((NC, HV, V, K), dt),
        v_new: T.Tensor((NT, HV, V), dt),
    ):
        with T.Kernel(V // BV, HV, NS, threads=threads) as (iv, hv, n):
            hk = hv // ratio
            bos = cu_seqlens[n]
            eos = cu_seqlens[n + 1]
            nchunks = T.ceildiv(eos - bos, C)
            first_chunk = chunk_offsets[n]
            base = T.cast(state_indices[n], "int64") * slot_stride + hv * (V * K) + iv * (BV * K)

            S_f = T.alloc_fragment((BV, K), f32)
            S_s = T.alloc_shared((BV, K), dt)
            w_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            G_s = T.alloc_shared((C,), f32)
            vn_f = T.alloc_fragment((C, BV), f32)
            vn_s = T.alloc_shared((C, BV), dt)
            u_s = T.alloc_shared((C, BV), dt)
            g_last = T.alloc_var(f32)

            if has_initial_state[n] != 0:
                for i, d in T.Parallel(BV, K):
                    S_f[i, d] = T.cast(pool[base + i * K + d], f32)
            else:
                T.clear(S_f)

            # Rows past a short last chunk hold the next sequence's data (or TMA's zero fill past
            # the end): they are loaded unmasked, so the copies can be asynchronous and pipelined,
            # and neutralised in registers (v' rows >= L set to zero before the state update).
            for c in T.Pipelined(nchunks, num_stages=num_stages):
                cs = bos + c * C
                L = T.min(eos - cs, C)
                T.copy(w[cs : cs + C, hv, :], w_s)
                T.copy(k_normed[cs : cs + C, hk, :], k_s)
                T.copy(u[cs : cs + C, hv, iv * BV : (iv + 1) * BV], u_s)
                T.copy(g_cum[cs : cs + C, hv], G_s)
                T.copy(S_f, S_s)
                # the state entering this chunk, for the output kernel
                T.copy(S_s, h_chunks[first_chunk + c, hv, iv * BV : (iv + 1) * BV, :])
                # v' = u - w h   (w h = w S^T with the V x K state S)
                T.gemm(w_s, S_s, vn_f, transpose_B=True, clear_accum=True)
                g_last = G_s[L - 1]
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.if_then_else(i < L, T.cast(u_s[i, j], f32) - vn_f[i, j], 0.0)
                for i, j in T.Parallel(C, BV):
                    if i < L:
                        v_new[cs + i, hv, iv * BV + j] = vn_f[i, j]
                # S' = exp(G_last) S + (v' exp(G_last - G))^T k
                for i, j in T.Parallel(C, BV):
                    vn_s[i, j] = T.if_then_else(i < L, vn_f[i, j] * T.exp(g_last - G_s[i]), 0.0)
                for i, d in T.Parallel(BV, K):
                    S_f[i, d] = S_f[i, d] * T.exp(g_last)
                T.gemm(vn_s, k_s, S_f, transpose_A=True)
                if ckpt_every_chunks > 0:
                    if L == C and (c + 1) % ckpt_every_chunks == 0:
                        row = ckpt_offsets[n] + (c + 1) // ckpt_every_chunks - 1
                        for i, d in T.Parallel(BV, K):
                            checkpoints[row, hv, iv * BV + i, d] = S_f[i, d]

            for i, d in T.Parallel(BV, K):
                pool[base + i * K + d] = S_f[i, d]

    return state


def _build_output(cfg: PrefillStaticConfig, threads: int):
    import tilelang.language as T

    H, HV, K, V, C = cfg.num_qk_heads, cfg.num_v_heads, HEAD_DIM, HEAD_DIM, CHUNK
    ratio = HV // H
    dt, f32 = cfg.dtype, "float32"
    l2 = cfg.use_qk_l2norm
    NT = T.dynamic("num_tokens", "int64")
    NC = T.dynamic("num_chunks", "int64")
    NS1 = T.dynamic("num_seqs_plus_one")

    @T.prim_func
    def output(
        q: T.Tensor((NT, H, K), dt),
        k_normed: T.Tensor((NT, H, K), dt),
        v_new: T.Tensor((NT, HV, V), dt),
        g_cum: T.Tensor((NT, HV), f32),
        h_chunks: T.Tensor((NC, HV, V, K), dt),
        cu_seqlens: T.Tensor((NS1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        scale: T.float32,
        o: T.Tensor((NT, HV, V), dt),
    ):
        with T.Kernel(NC, HV, threads=threads) as (ic, hv):
            hk = hv // ratio
            seq = chunk_indices[ic, 0]
            bos = cu_seqlens[seq] + chunk_indices[ic, 1] * C
            L = T.min(cu_seqlens[seq + 1] - bos, C)

            q_f = T.alloc_fragment((C, K), f32)
            sq_f = T.alloc_fragment((C, K), f32)
            sq = T.alloc_fragment((C,), f32)
            q_s = T.alloc_shared((C, K), dt)
            qg_s = T.alloc_shared((C, K), dt)
            k_s = T.alloc_shared((C, K), dt)
            h_s = T.alloc_shared((V, K), dt)
            vn_s = T.alloc_shared((C, V), dt)
            G_s = T.alloc_shared((C,), f32)
            a_f = T.alloc_fragment((C, C), f32)
            a_s = T.alloc_shared((C, C), dt)
            o_f = T.alloc_fragment((C, V), f32)

            for i, d in T.Parallel(C, K):
                q_f[i, d] = T.if_then_else(i < L, T.cast(q[bos + i, hk, d], f32), 0.0)
                k_s[i, d] = T.if_then_else(i < L, k_normed[bos + i, hk, d], T.cast(0, dt))
            for i, d in T.Parallel(C, V):
                vn_s[i, d] = T.if_then_else(i < L, v_new[bos + i, hv, d], T.cast(0, dt))
            for i in T.Parallel(C):
                G_s[i] = T.if_then_else(i < L, g_cum[bos + i, hv], 0.0)
            T.copy(h_chunks[ic, hv, :, :], h_s)
            if l2:
                for i, d in T.Parallel(C, K):
                    sq_f[i, d] = q_f[i, d] * q_f[i, d]
                T.reduce_sum(sq_f, sq, dim=1)
                for i, d in T.Parallel(C, K):
                    q_f[i, d] = q_f[i, d] * T.rsqrt(sq[i] + L2NORM_EPS)
            T.copy(q_f, q_s)
            for i, d in T.Parallel(C, K):
                qg_s[i, d] = q_f[i, d] * T.exp(G_s[i])

            T.gemm(qg_s, h_s, o_f, transpose_B=True, clear_accum=True)  # (q exp(G)) h
            T.gemm(q_s, k_s, a_f, transpose_B=True, clear_accum=True)  # q k^T
            for i, j in T.Parallel(C, C):
                a_s[i, j] = T.if_then_else(i >= j, a_f[i, j] * T.exp(G_s[i] - G_s[j]), 0.0)
            T.gemm(a_s, vn_s, o_f)
            for i, d in T.Parallel(C, V):
                if i < L:
                    o[bos + i, hv, d] = o_f[i, d] * scale

    return output


# --------------------------------------------------------------------------------------
# Compilation and cache
# --------------------------------------------------------------------------------------


def _kernel_set(cfg: PrefillStaticConfig):
    """The three compiled kernels of ``cfg``: built once per process (TileLang also caches on disk)."""
    global _compile_count
    ks = _kernels.get(cfg)
    if ks is not None:
        return ks
    with _lock:
        ks = _kernels.get(cfg)
        if ks is not None:
            return ks
        import tilelang

        tune = PREFILL_CONFIGS
        target, pc = _target(), _pass_configs()
        prep = tilelang.compile(_build_prep(cfg, tune.get("prep_threads", 128)), target=target, pass_configs=pc)
        state = tilelang.compile(
            _build_state(cfg, tune.get("state_block_v", 64), tune.get("state_threads", 128), tune.get("state_stages", 2)),
            target=target, pass_configs=pc,
        )
        output = tilelang.compile(_build_output(cfg, tune.get("output_threads", 128)), target=target, pass_configs=pc)
        ks = (prep, state, output)
        _kernels[cfg] = ks
        _compile_count += 1
        return ks


def static_config(q, v, beta, state_pool, use_qk_l2norm: bool) -> PrefillStaticConfig:
    return PrefillStaticConfig(
        num_qk_heads=q.shape[1], num_v_heads=v.shape[1], dtype=_TORCH_TO_TL[q.dtype],
        beta_dtype=_TORCH_TO_TL[beta.dtype], pool_dtype=_TORCH_TO_TL[state_pool.dtype],
        use_qk_l2norm=bool(use_qk_l2norm),
    )


def warmup(num_qk_heads: int, num_v_heads: int, *, dtype=torch.bfloat16, beta_dtype=None,
           pool_dtype=torch.float32, use_qk_l2norm: bool = True) -> None:
    """Compile (or load from TileLang's disk cache) one static configuration up front.

    Args:
        num_qk_heads / num_v_heads: ``H`` and ``HV`` (``HV % H == 0``).
        dtype: activation dtype, torch.bfloat16 or torch.float16.
        beta_dtype: dtype of beta, torch.float32 or ``dtype`` (default: ``dtype``).
        pool_dtype: state pool dtype, torch.float32 or torch.bfloat16.
        use_qk_l2norm: whether the kernels L2-normalise q and k.
    """
    if num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_qk_heads={num_qk_heads}")
    beta_dtype = dtype if beta_dtype is None else beta_dtype
    _kernel_set(PrefillStaticConfig(num_qk_heads, num_v_heads, _TORCH_TO_TL[dtype], _TORCH_TO_TL[beta_dtype],
                                    _TORCH_TO_TL[pool_dtype], bool(use_qk_l2norm)))


prepare = warmup


def _flat_pool(state_pool: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the pool from slot 0 to the end of the last slot (slot stride kept as is)."""
    n, hv, vd, kd = state_pool.shape
    if state_pool.stride()[1:] != (vd * kd, kd, 1):
        raise ValueError("state_pool's inner three dims [HV, V, K] must be contiguous")
    numel = (n - 1) * state_pool.stride(0) + hv * vd * kd
    return state_pool.as_strided((numel,), (1,))


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, *, scale: float, plan, state_pool, state_indices,
                               has_initial_state, use_qk_l2norm: bool, checkpoints=None, out) -> None:
    """Chunked GDN prefill on the engine's state pool, in place. No host sync, no per-shape compile.

    Args:
        q, k: ``[T, H, K]`` contiguous, bf16 or fp16, K = 128.
        v: ``[T, HV, V]`` contiguous, same dtype, V = 128, ``HV % H == 0``.
        g: ``[T, HV]`` float32 contiguous — per-token log decay (the chunk cumsum is done here).
        beta: ``[T, HV]`` contiguous, float32 or the activation dtype.
        scale: output scale.
        plan: :class:`qla_serving.plan.PrefillPlan` of this batch (device tables).
        state_pool: ``[num_slots, HV, V, K]`` float32 or bfloat16; inner three dims contiguous,
            slot stride free. Read at ``state_indices[i]`` where ``has_initial_state[i]`` (zeros
            otherwise) and overwritten there with the final state.
        state_indices: ``[N]`` int32 on the device.
        has_initial_state: ``[N]`` bool on the device.
        use_qk_l2norm: L2-normalise q and k inside (eps 1e-6 inside the sqrt).
        checkpoints: None or ``[plan.num_checkpoints, HV, V, K]`` contiguous in the pool dtype:
            row ``plan.checkpoint_offsets[i] + j`` gets sequence i's state after
            ``(j + 1) * plan.checkpoint_every`` tokens.
        out: ``[T, HV, V]`` contiguous, activation dtype; fully written.
    """
    _launch(q, k, v, g, beta, scale=scale, plan=plan, state_pool=state_pool, state_indices=state_indices,
            has_initial_state=has_initial_state, use_qk_l2norm=use_qk_l2norm, checkpoints=checkpoints, out=out)


def _launch(q, k, v, g, beta, *, scale, plan, state_pool, state_indices, has_initial_state, use_qk_l2norm,
            checkpoints, out) -> dict:
    """Runs the three kernels; returns the workspaces (w, u, g_cum, k_normed, v_new, h_chunks) for stage tests."""
    T_, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    assert K == HEAD_DIM and V == HEAD_DIM and HV % H == 0 and k.shape == q.shape
    assert out.shape == v.shape and out.dtype == q.dtype
    dev = q.device
    N = plan.num_seqs
    if T_ == 0 or N == 0:
        if N:
            # Only empty sequences: each final state is its initial state, or zeros without one.
            idx = state_indices.long()
            state_pool[idx] = torch.where(has_initial_state.view(-1, 1, 1, 1), state_pool[idx], 0).to(state_pool.dtype)
        return {}
    cfg = static_config(q, v, beta, state_pool, use_qk_l2norm)
    prep, state, output = _kernel_set(cfg)
    NC = plan.num_chunks
    # Workspaces: the caching allocator serves these without a sync and inside graph capture.
    w = torch.empty(T_, HV, K, dtype=q.dtype, device=dev)
    u = torch.empty(T_, HV, V, dtype=q.dtype, device=dev)
    v_new = torch.empty(T_, HV, V, dtype=q.dtype, device=dev)
    g_cum = torch.empty(T_, HV, dtype=torch.float32, device=dev)
    k_normed = torch.empty_like(k) if use_qk_l2norm else k
    h_chunks = torch.empty(max(NC, 1), HV, V, K, dtype=q.dtype, device=dev)
    every = plan.checkpoint_every or 0
    if checkpoints is None or every == 0 or checkpoints.shape[0] == 0:
        ckpt, every_chunks = plan.extras.get("_dummy_ckpt"), 0
        if ckpt is None or ckpt.dtype != state_pool.dtype or ckpt.shape[1] != HV or ckpt.device != dev:
            ckpt = torch.empty(1, HV, V, K, dtype=state_pool.dtype, device=dev)
            plan.extras["_dummy_ckpt"] = ckpt
    else:
        ckpt, every_chunks = checkpoints, every // CHUNK
    cu = plan.cu_seqlens
    prep(k, v, g, beta, cu, plan.chunk_indices, w, u, g_cum, k_normed)
    state(w, u, k_normed, g_cum, cu, plan.chunk_offsets, plan.checkpoint_offsets, state_indices,
          has_initial_state.view(torch.uint8), _flat_pool(state_pool), state_pool.stride(0), every_chunks,
          ckpt, h_chunks, v_new)
    output(q, k_normed, v_new, g_cum, h_chunks, cu, plan.chunk_indices, float(scale), out)
    return dict(w=w, u=u, g_cum=g_cum, k_normed=k_normed, v_new=v_new, h_chunks=h_chunks)


_SHORT = {"bf16": torch.bfloat16, "fp16": torch.float16, "f32": torch.float32}


def _warmup_spec(spec: str) -> str:
    """``"H:HV:dtype:beta_dtype:pool_dtype:l2"`` (dtypes bf16|fp16|f32, l2 0|1) -> compiled."""
    h, hv, dt, bdt, pdt, l2 = spec.split(":")
    warmup(int(h), int(hv), dtype=_SHORT[dt], beta_dtype=_SHORT[bdt], pool_dtype=_SHORT[pdt], use_qk_l2norm=l2 == "1")
    return spec


def main(argv=None) -> None:
    """Fill TileLang's disk cache for several static configs in parallel processes.

    ``python -m qla_serving.kernels.chunk_prefill 2:8:bf16:bf16:f32:1 16:64:bf16:bf16:f32:1 ...``
    """
    import argparse
    import concurrent.futures as cf
    import multiprocessing as mp
    import time

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("specs", nargs="+")
    ap.add_argument("-j", "--jobs", type=int, default=4)
    args = ap.parse_args(argv)
    t0 = time.time()
    with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
        for spec in ex.map(_warmup_spec, args.specs):
            print(f"ready {spec} at {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
