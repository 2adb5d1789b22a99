"""Fused gated-delta-rule decode step for SM90, in TileLang.

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
(:mod:`~.library`) or compiled with TileLang, and cached (:data:`compile_count` counts compiles).
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's annotations, which
# refer to the builder's local sizes.
import threading
from typing import NamedTuple

import torch

from ..constants import HEAD_DIM, L2NORM_EPS, SOFTPLUS_THRESHOLD
from ..constants import MAX_DECODE_TOKENS as MAX_TOKENS
from . import library
from .decode_tiles import (  # noqa: F401 - LANES_PER_ROW, _configured_tiles, force_tile: this module's API too
    LANES_PER_ROW,
    DecodeTile,
    _configured_tiles,
    force_tile,
    tile_for,
    tiles_to_compile,
)

K_DIM = V_DIM = HEAD_DIM

_TL_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
}


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


_cache: dict[DecodeStaticConfig, object] = {}
_cache_lock = threading.Lock()
_key_locks: dict[DecodeStaticConfig, threading.Lock] = {}
compile_count = 0  # kernels compiled with TileLang by this process (library loads not counted)


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


def _get_kernel(key: DecodeStaticConfig):
    """The kernel of one static configuration: from a precompiled library
    (:mod:`~.library`) when one holds it, else compiled with TileLang on first use.

    Different keys may compile in parallel threads (nvcc runs as a subprocess); one key
    compiles once.
    """
    global compile_count
    kernel = _cache.get(key)
    if kernel is not None:
        return kernel
    with _cache_lock:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:
        kernel = _cache.get(key)
        if kernel is None:
            kernel = library.lookup("decode", key)
            if kernel is None:
                tilelang = library.tilelang_for(f"decode kernel {key}")
                kernel = tilelang.compile(
                    _build(key),
                    target={"kind": "cuda", "arch": "sm_90a"},
                    # Addresses come from run-time slot numbers the compiler cannot bound; its
                    # guards would also stop the 16-byte vectorisation. The op layer checks shapes.
                    pass_configs={"tl.disable_safe_memory_legalize": True},
                )
                with _cache_lock:
                    compile_count += 1
            with _cache_lock:
                _cache[key] = kernel
    return kernel


def _tile_for(num_pairs: int, pool_dtype: torch.dtype) -> DecodeTile:
    """:func:`~.decode_tiles.tile_for` for a torch pool dtype."""
    return tile_for(num_pairs, _TL_DTYPES[pool_dtype])


def _key(
    H,
    HV,
    T_tok,
    q_dtype,
    ab_dtype,
    alog_dtype,
    bias_dtype,
    pool_dtype,
    idx_dtype,
    use_l2,
    has_inter,
    inplace,
    tile,
) -> DecodeStaticConfig:
    """The static configuration of a call, from its torch dtypes and flags."""
    return DecodeStaticConfig(
        H,
        HV,
        T_tok,
        _TL_DTYPES[q_dtype],
        _TL_DTYPES[ab_dtype],
        _TL_DTYPES[alog_dtype],
        _TL_DTYPES[bias_dtype],
        _TL_DTYPES[pool_dtype],
        _TL_DTYPES[idx_dtype],
        bool(use_l2),
        bool(has_inter),
        bool(inplace),
        DecodeTile(*tile),
    )


def warmup(
    H: int,
    HV: int,
    T: int = 1,
    *,
    dtype: torch.dtype = torch.bfloat16,
    pool_dtype: torch.dtype = torch.float32,
    gate_dtype: torch.dtype = torch.float32,
    bias_dtype: torch.dtype | None = None,
    ab_dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int32,
    use_qk_l2norm: bool = True,
    intermediate_states: bool = False,
    inplace_final_state: bool = True,
) -> int:
    """Load (from a precompiled library) or compile every tile variant of one static configuration.

    The kernel is keyed on every input's dtype, so each must be the one the engine will pass
    (a model may keep ``A_log`` in float32 and ``dt_bias`` in bf16).

    Args:
        H, HV: q/k heads and value heads. T: tokens per sequence (1..16).
        dtype: q/k/v dtype (bf16 or fp16). pool_dtype: float32 or bfloat16.
        gate_dtype: dtype of A_log. bias_dtype: dtype of dt_bias (default: gate_dtype).
        ab_dtype: dtype of a and b (default: dtype). index_dtype: int32 or int64.
        use_qk_l2norm, intermediate_states, inplace_final_state: the call's flags.

    Returns:
        the number of kernels compiled by this call (0 when all were cached).
    """
    before = compile_count
    for key in _warmup_keys(H, HV, T, dtype, pool_dtype, gate_dtype, bias_dtype, ab_dtype, index_dtype,
                            use_qk_l2norm, intermediate_states, inplace_final_state):
        _get_kernel(key)
    return compile_count - before


def _warmup_keys(H, HV, T, dtype, pool_dtype, gate_dtype, bias_dtype, ab_dtype, index_dtype, use_qk_l2norm,
                 intermediate_states, inplace_final_state) -> list[DecodeStaticConfig]:
    bias_dtype = gate_dtype if bias_dtype is None else bias_dtype
    ab_dtype = dtype if ab_dtype is None else ab_dtype
    return [_key(H, HV, T, dtype, ab_dtype, gate_dtype, bias_dtype, pool_dtype, index_dtype, use_qk_l2norm,
                 intermediate_states, inplace_final_state, tile)
            for tile in sorted(tiles_to_compile(_TL_DTYPES[pool_dtype]))]


def missing(H: int, HV: int, T: int = 1, *, dtype=torch.bfloat16, pool_dtype=torch.float32,
            gate_dtype=torch.float32, bias_dtype=None, ab_dtype=None, index_dtype=torch.int32,
            use_qk_l2norm: bool = True, intermediate_states: bool = False, inplace_final_state: bool = True
            ) -> list[str]:
    """The kernels :func:`warmup` (same arguments) needs that no precompiled library holds."""
    keys = _warmup_keys(H, HV, T, dtype, pool_dtype, gate_dtype, bias_dtype, ab_dtype, index_dtype,
                        use_qk_l2norm, intermediate_states, inplace_final_state)
    return [f"decode {key}" for key in keys if key not in _cache and not library.has("decode", key)]


def _flat(x: torch.Tensor, span: int) -> torch.Tensor:
    """A 1-D view of ``span`` elements starting at x's first element (no copy)."""
    return torch.as_strided(x, (span,), (1,))


def _token_rows(x: torch.Tensor, name: str, inner: tuple[int, ...]) -> int:
    """The token stride of ``x`` (``[N, T, *inner]``, ``inner`` contiguous, the ``N x T`` tokens one
    stride apart)."""
    N, T_tok = x.shape[0], x.shape[1]
    st = x.stride()
    assert st[-1] == 1 and (len(inner) == 1 or inner[0] == 1 or st[-2] == inner[-1]), (
        f"{name}: inner dims not contiguous, strides {st}")
    if T_tok > 1:
        assert N == 1 or st[0] == T_tok * st[1], f"{name}: tokens not one stride apart, strides {st}"
        return st[1]
    return st[0] if N > 1 else 0


def gated_delta_rule_decode_fwd(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    *,
    state_pool,
    state_indices,
    scale: float,
    use_qk_l2norm: bool,
    out,
    intermediate_states=None,
    inplace_final_state: bool = True,
    min_slot: int = 0,
) -> None:
    """Run the fused decode step (kernel entry point; the op layer validates the inputs).

    Args:
        q, k: ``[N, T, H, K]`` bf16/fp16; K = 128; T = 1..16 tokens per sequence. ``[H, K]``
            contiguous per token, the ``N * T`` tokens one stride apart, that stride a multiple
            of ``H * K`` and the data pointer of 16 bytes: a contiguous tensor, or q's and k's
            column ranges of a packed ``[tokens, (2H + HV) * K]`` buffer.
        v: ``[N, T, HV, V]`` q's dtype, ``[HV, V]`` contiguous per token, tokens one stride
            apart; V = 128; ``HV % H == 0`` and value head ``hv`` reads q/k head ``hv // (HV // H)``.
        a, b: ``[N, T, HV]`` bf16/fp16/fp32 — gate inputs (decay, write strength); ``HV``
            contiguous per token, tokens one stride apart.
        A_log, dt_bias: ``[HV]`` float32 (bf16/fp16 accepted).
        state_pool: ``[num_slots, HV, V, K]`` float32 or bfloat16; ``[HV, V, K]`` contiguous,
            slot stride ``stride(0) >= HV*V*K`` (a multiple of 16 bytes); updated in place.
        state_indices: ``[N]`` int32/int64 on the device; a value below ``min_slot`` skips the
            row (state untouched, output rows zero). Other values must be valid distinct slots
            (not checked here).
        scale: output scale. use_qk_l2norm: L2-normalise q and k (eps 1e-6 inside the sqrt).
        out: ``[N, T, HV, V]`` q's dtype, contiguous — receives the output.
        intermediate_states: None or ``[N, T, HV, V, K]`` in the pool dtype, contiguous —
            receives the state after each token (rows of padded sequences are not written).
        inplace_final_state: write the state after the last token back to the pool.
        min_slot: the lowest slot number of a live row (0: ``-1`` marks padding).

    No host synchronisation and no allocation: CUDA-graph capturable once the configuration
    is compiled (call :func:`warmup` or run once before capture).
    """
    N, T_tok, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert K == K_DIM and V == V_DIM and 1 <= T_tok <= MAX_TOKENS and HV % H == 0
    assert state_pool.stride()[1:] == (V * K, K, 1)
    vec = 16 // state_pool.element_size()
    slot_stride = state_pool.stride(0)
    # 16-byte vector accesses need a 16-byte-aligned base and slot stride.
    assert state_pool.data_ptr() % 16 == 0 and slot_stride % vec == 0
    pool_flat = _flat(state_pool, (state_pool.shape[0] - 1) * slot_stride + HV * V * K)
    if intermediate_states is not None:
        assert intermediate_states.is_contiguous() and intermediate_states.dtype == state_pool.dtype
        inter_flat = intermediate_states.view(-1)
    else:
        inter_flat = pool_flat  # unused by the kernel compiled without intermediates
    if N == 0:
        return
    tokens = N * T_tok
    strides = [_token_rows(x, name, inner) for x, name, inner in
               ((q, "q", (H, K)), (k, "k", (H, K)), (v, "v", (HV, V)), (a, "a", (HV,)), (b, "b", (HV,)))]
    for x, stride in ((q, strides[0]), (k, strides[1])):
        assert x.data_ptr() % 16 == 0 and stride % (H * K) == 0, "q/k tokens must start at multiples of H*K"
    assert max(strides) < 2**31
    q_k = [torch.as_strided(x, ((tokens - 1) * (st // (H * K)) + 1, H, K), (H * K, K, 1))
           for x, st in ((q, strides[0]), (k, strides[1]))]
    v_a_b = [_flat(x, (tokens - 1) * st + w) for x, st, w in zip((v, a, b), strides[2:], (HV * V, HV, HV))]
    key = _key(
        H,
        HV,
        T_tok,
        q.dtype,
        a.dtype,
        A_log.dtype,
        dt_bias.dtype,
        state_pool.dtype,
        state_indices.dtype,
        use_qk_l2norm,
        intermediate_states is not None,
        inplace_final_state,
        _tile_for(N * HV, state_pool.dtype),
    )
    kernel = _get_kernel(key)
    kernel(
        *q_k,
        *v_a_b,
        A_log,
        dt_bias,
        pool_flat,
        state_indices,
        out,
        inter_flat,
        slot_stride // vec,
        strides[0] // (H * K),
        strides[1] // (H * K),
        strides[2],
        strides[3],
        strides[4],
        int(min_slot),
        float(scale),
    )


def compiled_kernels() -> int:
    """How many decode kernels this process has compiled (or loaded) so far."""
    return compile_count


__all__ = [
    "MAX_TOKENS",
    "DecodeTile",
    "compiled_kernels",
    "force_tile",
    "gated_delta_rule_decode_fwd",
    "missing",
    "warmup",
]
