"""Fused gated-delta-rule decode step for SM90: the TileLang program.

One launch does, for every sequence ``n`` and value head ``hv``, ``T`` (1..16) recurrent steps
on the state ``S = pool[state_indices[n], hv]`` (``V x K``, the engines' layout):

    g    = -exp(A_log) * softplus(a + dt_bias)        beta = sigmoid(b)
    S    = exp(g) * S                                 (decay)
    S   += beta * (v - S k) k^T                       (delta rule)
    o    = scale * S q

with q, k L2-normalised first when asked. The step is memory-bound (each (n, hv) reads and
writes 64 KiB of fp32 state for ~1 MFLOP), so the kernel is laid out for bandwidth:

* grid ``(V / rows_per_cta, HV, N)``: one CTA per (sequence, value head, slice of state
  rows), so even small batches put several CTAs per SM in flight;
* a row of K = 128 state values is shared by ``lanes_per_row`` consecutive lanes (8 by
  default), each holding ``128 / lanes_per_row`` values as 16-byte vectors (4 fp32 or 8 bf16
  per load): every warp load covers whole 32-byte sectors, and the two dot products over K
  (``S k`` and ``S q``) need only log2(lanes_per_row) butterfly shuffles;
* the tile (:class:`DecodeTile`: rows per CTA, threads, lanes per row, and the minimum
  resident CTAs per SM handed to ``__launch_bounds__``) sets how many 16-byte loads each
  thread has in flight and how many CTAs share an SM; it is chosen per pool dtype and
  number of (sequence, head) pairs from ``DECODE_CONFIGS`` (``qla-serving bench decode
  --sweep-tiles`` measures candidates);
* each CTA waits for memory once: the activations (q, k, v rows, a, b, A_log, dt_bias) are
  loaded together with the state index, before anything depends on the slot, and the state
  loads follow the index; padded rows (index -1) run the same arithmetic on a zero state with
  every store masked, which keeps the compiler from sinking the activation loads behind the
  slot test (slot test first is slower: ``e2e_bench/results/2026-11-21-nvidia-h200-decode-tiles.md``,
  tiles marked ``late``);
* the state stays in registers across the ``T`` tokens; it is read once and written once
  (plus once per token into ``intermediate_states`` when the caller wants it); a streaming
  tile (``s``) stores each row of a single-token step as soon as it is updated.

The pool is passed as a flat 1-D view with the slot stride as a run-time scalar (in units of
one 16-byte vector, so the compiler can prove the vector loads aligned): vLLM's pool is a
view whose slot stride exceeds ``HV * V * K`` (it shares a buffer with the conv state).
The activations come with run-time token strides (q and k as ``[rows, H, K]`` with a token every
``stride`` rows, v, a and b as flat views): q, k and v may be the column ranges of the engine's
packed ``[tokens, (2H + HV) * 128]`` conv output and a, b the columns of its packed gate
projection, read in place (no split copies before the kernel).
Rows whose slot is below the run-time ``min_slot`` are padding (``-1`` by default; vLLM's null
block 0 with ``min_slot = 1``).

The number of sequences ``N`` is a run-time value; a kernel exists once per static
configuration (head counts, T, dtypes, flags, tile): loaded from a precompiled library
(:mod:`~.library`) or compiled with TileLang (:mod:`~.decode`: selection, loading, launch).
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's annotations, which
# refer to the builder's local sizes.
# This file, decode_tiles.py and constants.py are what a kernel library is built from (their code
# is its digest, library.SOURCE_FILES): what selects, loads and launches a kernel is in decode.py.
from typing import NamedTuple

from ..constants import HEAD_DIM, L2NORM_EPS, SOFTPLUS_THRESHOLD
from .decode_tiles import DecodeTile

K_DIM = V_DIM = HEAD_DIM


class DecodeStaticConfig(NamedTuple):
    """Everything a compiled decode kernel depends on (dtypes as TileLang names); the batch
    size, pool size and slot numbers are run-time values. Also the kernel cache's key."""

    num_qk_heads: int
    num_v_heads: int
    tokens: int  # tokens per sequence, 1..MAX_TOKENS
    q_dtype: str  # q, k, v and the output
    ab_dtype: str
    alog_dtype: str
    bias_dtype: str
    pool_dtype: str
    idx_dtype: str
    use_l2: bool
    has_inter: bool  # writes the state after every token to a caller buffer
    inplace: bool  # writes the final state back to the pool
    tile: DecodeTile



def _build(cfg: DecodeStaticConfig):
    """The TileLang program for one static configuration."""
    import tilelang.language as T

    H, HV, T_tok = cfg.num_qk_heads, cfg.num_v_heads, cfg.tokens
    q_dtype, ab_dtype, alog_dtype, bias_dtype = cfg.q_dtype, cfg.ab_dtype, cfg.alog_dtype, cfg.bias_dtype
    pool_dtype, idx_dtype = cfg.pool_dtype, cfg.idx_dtype
    use_l2, has_inter, inplace = cfg.use_l2, cfg.has_inter, cfg.inplace
    rows_per_cta, threads, lanes_per_row, min_blocks, stream = cfg.tile
    cfg.tile.check(pool_dtype)
    streaming = stream and T_tok == 1 and inplace
    K, V = K_DIM, V_DIM
    LANES = lanes_per_row
    shuffles = LANES.bit_length() - 1  # butterfly steps over the lanes of one row
    vec = 16 // (4 if pool_dtype == "float32" else 2)  # state elements per 16-byte access
    per_lane = K // LANES  # state values of one row held by one lane
    nvec = per_lane // vec
    rows_per_pass = threads // LANES
    R = rows_per_cta // rows_per_pass  # rows per thread
    group = HV // H
    acc = "float32"
    N = T.dynamic("N")
    q_rows, k_rows, v_len = T.dynamic("q_rows"), T.dynamic("k_rows"), T.dynamic("v_len")
    a_len, b_len = T.dynamic("a_len"), T.dynamic("b_len")
    pool_len = T.dynamic("pool_len")
    inter_len = T.dynamic("inter_len")

    def col(i, j, gl):
        # Column of a lane's i-th vector, element j: a row's LANES lanes tile LANES*vec columns.
        return i * (LANES * vec) + gl * vec + j

    @T.macro
    def load_token(q, k, v, a, b, kk, qq, vv, ab, tok, hv, hq, gl, row0, strides):
        # Every activation of one token, issued together and before any arithmetic: ptxas does
        # not move loads across the branches of log1p, so loads placed after the gate would
        # add their latency to every CTA's critical path. q and k are [rows, H, K] with a token
        # every strides[0] (strides[1]) rows; the int32 strides keep the index arithmetic one
        # the vectoriser proves aligned (with int64 strides it halves the q/k loads).
        q_row = tok * strides[0]
        k_row = tok * strides[1]

        for i in T.unroll(nvec):
            for j in T.vectorized(vec):
                kk[i * vec + j] = T.cast(k[k_row, hq, col(i, j, gl)], acc)
                qq[i * vec + j] = T.cast(q[q_row, hq, col(i, j, gl)], acc)
        for r in T.unroll(R):
            vv[r] = T.cast(v[tok * strides[2] + hv * V + row0 + r * rows_per_pass], acc)
        ab[0] = T.cast(a[tok * strides[3] + hv], acc)
        ab[1] = T.cast(b[tok * strides[4] + hv], acc)

    @T.prim_func
    def gdn_decode(
        q: T.Tensor((q_rows, H, K), q_dtype),
        k: T.Tensor((k_rows, H, K), q_dtype),
        v: T.Tensor((v_len,), q_dtype),
        a: T.Tensor((a_len,), ab_dtype),
        b: T.Tensor((b_len,), ab_dtype),
        A_log: T.Tensor((HV,), alog_dtype),
        dt_bias: T.Tensor((HV,), bias_dtype),
        pool: T.Tensor((pool_len,), pool_dtype),
        state_indices: T.Tensor((N,), idx_dtype),
        o: T.Tensor((N, T_tok, HV, V), q_dtype),
        inter: T.Tensor((inter_len,), pool_dtype),
        slot_stride_vec: T.int64,
        q_stride: T.int32,
        k_stride: T.int32,
        v_stride: T.int32,
        a_stride: T.int32,
        b_stride: T.int32,
        min_slot: T.int64,
        scale: T.float32,
    ):
        with T.Kernel(V // rows_per_cta, HV, N, threads=threads) as (bv, hv, n):
            if min_blocks:
                T.annotate_min_blocks_per_sm(min_blocks)
            tx = T.get_thread_binding()
            gl = tx % LANES
            row0 = bv * rows_per_cta + tx // LANES
            # Streaming keeps the loaded rows in the pool dtype (bf16: half the registers per byte
            # in flight) and converts, updates and stores one row at a time.
            S = T.alloc_local((R, per_lane), pool_dtype if streaming else acc)
            row_acc = T.alloc_local((per_lane,), acc)
            kk = T.alloc_local((per_lane,), acc)
            qq = T.alloc_local((per_lane,), acc)
            vv = T.alloc_local((R,), acc)  # v at this thread's rows, current token
            ab = T.alloc_local((2,), acc)  # a, b of the current token
            par = T.alloc_local((2,), acc)  # A_log, dt_bias of this head
            red = T.alloc_local((2,), acc)
            gate = T.alloc_local((2,), acc)  # exp(g), beta of the current token
            slot = T.cast(state_indices[n], "int64")
            live = slot >= min_slot
            strides = (q_stride, k_stride, v_stride, a_stride, b_stride)
            tok0 = n * T_tok
            hq = hv // group
            # Nothing before the state loads depends on the slot, and padded rows (slot < min_slot) run
            # the same arithmetic on a zero state with every store masked: the activation loads then
            # have uses on every path, so the compiler issues them together with the index load
            # instead of sinking them behind the slot test, and each CTA waits for memory once.
            par[0] = T.cast(A_log[hv], acc)
            par[1] = T.cast(dt_bias[hv], acc)
            load_token(q, k, v, a, b, kk, qq, vv, ab, tok0, hv, hq, gl, row0, strides)
            base = slot * slot_stride_vec * vec + T.cast(hv * (V * K), "int64")
            if live:
                for r in T.unroll(R):
                    for i in T.unroll(nvec):
                        for j in T.vectorized(vec):
                            S[r, i * vec + j] = T.cast(
                                pool[base + (row0 + r * rows_per_pass) * K + col(i, j, gl)], S.dtype
                            )
            else:
                for r in T.unroll(R):
                    for e in T.unroll(per_lane):
                        S[r, e] = T.cast(0, S.dtype)
            for t in T.serial(T_tok):
                x = ab[0] + par[1]
                softplus = T.if_then_else(x > SOFTPLUS_THRESHOLD, x, T.log1p(T.exp(x)))
                gate[0] = T.exp(-T.exp(par[0]) * softplus)
                gate[1] = 1.0 / (1.0 + T.exp(-ab[1]))
                if use_l2:
                    red[0] = 0.0
                    red[1] = 0.0
                    for e in T.unroll(per_lane):
                        red[0] += kk[e] * kk[e]
                        red[1] += qq[e] * qq[e]
                    for s in T.unroll(shuffles):
                        red[0] += T.shfl_xor(red[0], 1 << s)
                        red[1] += T.shfl_xor(red[1], 1 << s)
                    red[0] = T.rsqrt(red[0] + L2NORM_EPS)
                    red[1] = T.rsqrt(red[1] + L2NORM_EPS) * scale
                    for e in T.unroll(per_lane):
                        kk[e] = kk[e] * red[0]
                        qq[e] = qq[e] * red[1]
                else:
                    for e in T.unroll(per_lane):
                        qq[e] = qq[e] * scale
                for r in T.unroll(R):
                    row = row0 + r * rows_per_pass
                    for e in T.unroll(per_lane):
                        row_acc[e] = T.cast(S[r, e], acc)
                    red[0] = 0.0
                    for e in T.unroll(per_lane):
                        row_acc[e] = row_acc[e] * gate[0]
                        red[0] += row_acc[e] * kk[e]
                    for s in T.unroll(shuffles):
                        red[0] += T.shfl_xor(red[0], 1 << s)
                    red[0] = gate[1] * (vv[r] - red[0])
                    red[1] = 0.0
                    for e in T.unroll(per_lane):
                        row_acc[e] = row_acc[e] + red[0] * kk[e]
                        red[1] += row_acc[e] * qq[e]
                    for s in T.unroll(shuffles):
                        red[1] += T.shfl_xor(red[1], 1 << s)
                    if gl == 0:
                        # Padded rows: zero output.
                        o[n, t, hv, row] = T.cast(T.if_then_else(live, red[1], 0.0), q_dtype)
                    if has_inter:  # noqa: SIM102 (build-time flag around a run-time test)
                        if live:
                            ibase = ((T.cast(n, "int64") * T_tok + t) * HV + hv) * (V * K)
                            for i in T.unroll(nvec):
                                for j in T.vectorized(vec):
                                    inter[ibase + row * K + col(i, j, gl)] = T.cast(
                                        row_acc[i * vec + j], pool_dtype
                                    )
                    if streaming:
                        # The only token: the row goes back to the pool as soon as it is done.
                        if live:
                            for i in T.unroll(nvec):
                                for j in T.vectorized(vec):
                                    pool[base + row * K + col(i, j, gl)] = T.cast(
                                        row_acc[i * vec + j], pool_dtype
                                    )
                    else:
                        for e in T.unroll(per_lane):
                            S[r, e] = row_acc[e]
                if T_tok > 1:  # noqa: SIM102 (a build-time condition around a run-time one)
                    if t + 1 < T_tok:
                        load_token(q, k, v, a, b, kk, qq, vv, ab, tok0 + t + 1, hv, hq, gl, row0, strides)
            if inplace and not streaming:  # noqa: SIM102 (build-time flag around a run-time test)
                if live:
                    for r in T.unroll(R):
                        for i in T.unroll(nvec):
                            for j in T.vectorized(vec):
                                pool[base + (row0 + r * rows_per_pass) * K + col(i, j, gl)] = T.cast(
                                    S[r, i * vec + j], pool_dtype
                                )

    return gdn_decode



def compile_kernel(cfg: DecodeStaticConfig, tilelang):
    """``cfg``'s kernel compiled with ``tilelang`` (the module), as the library build compiles it."""
    return tilelang.compile(
        _build(cfg),
        target={"kind": "cuda", "arch": "sm_90a"},
        # Addresses come from run-time slot numbers the compiler cannot bound; its guards would
        # also stop the 16-byte vectorisation. The op layer checks shapes.
        pass_configs={"tl.disable_safe_memory_legalize": True},
    )
