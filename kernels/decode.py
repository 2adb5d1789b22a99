"""Fused gated-delta-rule decode step for SM90: a call's static configuration, its kernel
(from a precompiled library, else compiled with TileLang, once per configuration), warm-up and
launch. The kernel itself, and what it computes, is :mod:`~.decode_program`.
"""

import threading

import torch

from ..constants import MAX_DECODE_TOKENS as MAX_TOKENS
from . import library
from .decode_program import K_DIM, V_DIM, DecodeStaticConfig, _build, compile_kernel  # noqa: F401 - _build: this module's API too
from .decode_tiles import (  # noqa: F401 - LANES_PER_ROW, _configured_tiles, force_tile: this module's API too
    LANES_PER_ROW,
    DecodeTile,
    _configured_tiles,
    force_tile,
    tile_for,
    tiles_to_compile,
)

_TL_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int32: "int32",
    torch.int64: "int64",
}


_cache: dict[DecodeStaticConfig, object] = {}
_cache_lock = threading.Lock()
_key_locks: dict[DecodeStaticConfig, threading.Lock] = {}
compile_count = 0  # kernels compiled with TileLang by this process (library loads not counted)


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
                kernel = compile_kernel(key, library.tilelang_for(f"decode kernel {key}"))
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


def token_stride(x: torch.Tensor, inner: tuple[int, ...], row_multiple: int = 1) -> int | None:
    """The token stride (elements) at which the kernel reads ``x`` (``[N, T, *inner]``) in place,
    or None where it cannot: ``inner`` contiguous per token, the ``N * T`` tokens one stride
    apart, that stride at least one token wide and a multiple of ``row_multiple`` (0 for a single
    token). A contiguous tensor qualifies, and so does a column range of a packed buffer."""
    st = x.stride()
    width = 1
    for d in range(len(inner) - 1, -1, -1):
        if inner[d] > 1 and st[2 + d] != width:
            return None
        width *= inner[d]
    N, T_tok = x.shape[0], x.shape[1]
    if T_tok > 1:
        if N > 1 and st[0] != T_tok * st[1]:
            return None
        step = st[1]
    elif N > 1:
        step = st[0]
    else:
        return 0
    return step if step >= width and step % row_multiple == 0 else None


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
    token_strides: tuple[int, ...] | None = None,
    bind: dict | None = None,
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
        token_strides: :func:`token_stride` of q, k, v, a and b when the caller has them (the op
            works them out to decide its copies); worked out here when None.
        bind: a dict that receives, as ``bind["decode"]``, this launch as a
            :class:`~.library.BoundKernel` taking the addresses of q, k, v, a, b, A_log, dt_bias,
            state_pool and out (:data:`DECODE_BOUND_INPUTS`, in that order): another layer's
            tensors of the same shapes, strides and dtypes, with these state_indices, launch with
            it alone. Library kernels without intermediate states only; left untouched otherwise.

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
    if intermediate_states is not None:
        assert intermediate_states.is_contiguous() and intermediate_states.dtype == state_pool.dtype
    if N == 0:
        return
    tokens = N * T_tok
    if token_strides is None:
        token_strides = tuple(token_stride(x, inner, rows) for x, inner, rows in
                              ((q, (H, K), H * K), (k, (H, K), H * K), (v, (HV, V), 1), (a, (HV,), 1),
                               (b, (HV,), 1)))
    strides = token_strides
    assert None not in strides, f"an input the kernel cannot read in place: token strides {strides}"
    assert q.data_ptr() % 16 == 0 and k.data_ptr() % 16 == 0, "q/k must start 16-byte aligned"
    assert max(strides) < 2**31
    # What the kernel reads: q and k as [rows, H, K] from their first token (a packed buffer's
    # columns: rows = whole packed rows spanned), v, a, b, the pool and the intermediates flat.
    qk_rows = [(tokens - 1) * (st // (H * K)) + 1 for st in strides[:2]]
    flat_lens = [(tokens - 1) * st + w for st, w in zip(strides[2:], (HV * V, HV, HV))]
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
    # A library kernel reads only pointers and shapes: spans instead of views (no torch op).
    span_device = q.device if isinstance(kernel, library.LibraryKernel) else None
    arg = library.launch_arg
    q_k = [arg(x, (rows, H, K), (H * K, K, 1), span_device) for x, rows in zip((q, k), qk_rows)]
    v_a_b = [arg(x, (n,), (1,), span_device) for x, n in zip((v, a, b), flat_lens)]
    pool_flat = library.pool_arg(state_pool, span_device)
    # (unused by the kernel compiled without intermediates)
    inter_flat = pool_flat if intermediate_states is None else arg(
        intermediate_states, (intermediate_states.numel(),), (1,), span_device)
    args = (*q_k, *v_a_b, A_log, dt_bias, pool_flat, state_indices, out, inter_flat, slot_stride // vec,
            strides[0] // (H * K), strides[1] // (H * K), strides[2], strides[3], strides[4], int(min_slot),
            float(scale))
    kernel(*args)
    if bind is not None and intermediate_states is None and isinstance(kernel, library.LibraryKernel):
        # argument position -> DECODE_BOUND_INPUTS index (the pool is read and written through
        # the unused intermediates argument's slot too)
        bind["decode"] = kernel.bind(args, {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 7, 9: 8, 10: 7})


# The tensors whose addresses a bound decode launch takes, in order (``bind`` above).
DECODE_BOUND_INPUTS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool", "out")


def compiled_kernels() -> int:
    """How many decode kernels this process has compiled (or loaded) so far."""
    return compile_count


__all__ = [
    "DECODE_BOUND_INPUTS",
    "MAX_TOKENS",
    "DecodeTile",
    "compiled_kernels",
    "force_tile",
    "gated_delta_rule_decode_fwd",
    "missing",
    "warmup",
]
