"""Decode step of the gated delta rule: 1..8 tokens per sequence, state in the pool, gate in the op.

Runs the TileLang decode kernel where :mod:`qla_serving.backend` allows, and otherwise the
PyTorch reference (float32), saying so once in the log.
"""

from __future__ import annotations

import torch

from ... import backend
from ...constants import MAX_DECODE_TOKENS
from . import checks
from .naive import recurrent_decode_ref


_kernel_module = None


def _kernel():
    """The decode kernel's host module (imported on first use, then kept: an attribute read per
    call instead of an import statement; it loads no TileLang)."""
    global _kernel_module
    if _kernel_module is None:
        from ...kernels import decode

        _kernel_module = decode
    return _kernel_module


def _readable(token_stride, x: torch.Tensor, inner: tuple[int, ...], row_multiple: int = 1,
              aligned: bool = False):
    """``x`` and the token stride the kernel reads it at: in place where the kernel module's
    ``token_stride`` rule allows (and, with ``aligned``, its data 16-byte aligned), else a
    contiguous copy."""
    st = token_stride(x, inner, row_multiple)
    if st is None or (aligned and x.data_ptr() % 16):
        x = x.contiguous()
        st = token_stride(x, inner, row_multiple)
    return x, st


def _decode_kernel():
    """The TileLang decode step's entry point."""
    return _kernel().gated_delta_rule_decode_fwd


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    intermediate_states: torch.Tensor | None = None,
    inplace_final_state: bool = True,
    out: torch.Tensor | None = None,
    min_slot: int = 0,
    bind: dict | None = None,
) -> torch.Tensor:
    """One decode step (or up to 16 tokens per sequence, for speculative verify).

    The gate is computed inside: ``g = -exp(A_log) * softplus(a + dt_bias)`` and
    ``beta = sigmoid(b)``. CUDA-graph capturable on the kernel path (fixed shapes, no sync).

    Args:
        q: ``[N, H, K]`` (one token) or ``[N, T, H, K]`` (``T <= 16`` tokens), bf16/fp16
            (fp32 runs the reference) — queries. Read in place when ``[H, K]`` is contiguous per
            token and the tokens are one stride apart, a multiple of ``H * K`` (a contiguous
            tensor, or the q columns of the engine's packed ``[tokens, (2H + HV) * K]`` conv
            output); copied first otherwise.
        k: q's shape and dtype — keys; the same layout rule.
        v: ``[N, HV, V]`` or ``[N, T, HV, V]``, q's dtype — values; ``HV`` a multiple of ``H``;
            read in place when ``[HV, V]`` is contiguous per token, tokens one stride apart.
        a: ``[N, HV]`` or ``[N, T, HV]`` — decay input (float dtype); read in place when ``HV``
            is contiguous per token, tokens one stride apart (e.g. a column range of the
            packed gate projection).
        b: a's shape — write-strength input (float dtype); a's layout rule.
        A_log: ``[HV]`` float32 (or bf16) — per-head log decay rate.
        dt_bias: ``[HV]`` float32 (or bf16) — per-head bias of ``a``.
        state_pool: ``[num_slots, HV, V, K]`` float32 or bfloat16 — the engine's pool,
            ``[HV, V, K]`` contiguous per slot, any slot stride; updated in place.
        state_indices: ``[N]`` int32/int64, any stride (a strided one is copied first) — slot of
            each sequence; ``-1`` (or any value below
            ``min_slot``) marks a padded row (CUDA-graph batches): its state is untouched and
            its output rows are zero.
        scale: output scale, ``K ** -0.5`` when None.
        use_qk_l2norm_in_kernel: L2-normalise q and k inside the op.
        intermediate_states: optional ``[N, T, HV, V, K]`` in the pool's dtype — receives the
            state after each token (the engine keeps the accepted prefix).
        inplace_final_state: write the state after the last token back to the pool. Set
            False in speculative verify to leave the pool for the engine to update.
        out: optional output buffer of v's shape and q's dtype.
        min_slot: the lowest slot of a live row (default 0). vLLM passes 1: its padded rows
            point at its null block 0, which no request owns.
        bind: optional dict that receives ``bind["decode"]``, this call's launch bound to
            everything but the addresses of q, k, v, a, b, A_log, dt_bias, state_pool and out
            (``qla_serving.kernels.decode.DECODE_BOUND_INPUTS``): for the same call on another
            layer's tensors of identical shapes, strides and dtypes with these state_indices
            (an engine's later GDN layers of a step), without the checks. Set only where the
            kernels read every input in place from a precompiled library, without intermediates.

    Returns:
        ``o``: v's shape (``[N, HV, V]`` or ``[N, T, HV, V]``), q's dtype.
    """
    checks.expect_rank("q", q, (3, 4), "[N, H, K] or [N, T, H, K]")
    single = q.dim() == 3
    if single:
        q, k, v, a, b = (x.unsqueeze(1) if isinstance(x, torch.Tensor) else x for x in (q, k, v, a, b))
        if out is not None:
            out = out.unsqueeze(1)
    N, T, H, K = q.shape
    checks.expect_shape("k", k, (N, T, H, K), "like q")
    checks.expect_rank("v", v, (4,), "[N, T, HV, V]")
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (N, T):
        raise ValueError(f"v has leading dims {tuple(v.shape[:2])} but q has (N, T) = {(N, T)}")
    checks.expect_heads(H, HV)
    if not 1 <= T <= MAX_DECODE_TOKENS:
        raise ValueError(f"decode takes 1 to {MAX_DECODE_TOKENS} tokens per sequence, got T={T}")
    checks.expect_shape("a", a, (N, T, HV), "[N, (T,) HV]")
    checks.expect_shape("b", b, (N, T, HV), "[N, (T,) HV]")
    checks.expect_shape("A_log", A_log, (HV,), "[HV]")
    checks.expect_shape("dt_bias", dt_bias, (HV,), "[HV]")
    checks.expect_dtype("q", q, checks.ACTIVATION_DTYPES)
    checks.expect_same_dtype("q", q, k=k, v=v)
    for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        checks.expect_dtype(name, x, checks.ACTIVATION_DTYPES)
    checks.expect_pool("state_pool", state_pool, HV, V, K)
    checks.expect_same_device(q.device, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias,
                              state_pool=state_pool, state_indices=state_indices,
                              intermediate_states=intermediate_states, out=out)
    # Row-strided views are read in place (the kernel module's rule); anything else is copied into
    # the layout the kernel reads. The strides go to the kernel entry as they are.
    rule = _kernel().token_stride
    given = (q, k, v, a, b)
    q, st_q = _readable(rule, q, (H, K), H * K, aligned=True)
    k, st_k = _readable(rule, k, (H, K), H * K, aligned=True)
    v, st_v = _readable(rule, v, (HV, V))
    a, st_a = _readable(rule, a, (HV,))
    b, st_b = _readable(rule, b, (HV,))
    if bind is not None and any(x is not y for x, y in zip((q, k, v, a, b), given)):
        bind = None  # a launch bound to a copy would read this call's copy in every later call
    checks.expect_slots("state_indices", state_indices, state_pool.shape[0], N, allow_padding=True,
                        min_slot=min_slot)
    if not state_indices.is_contiguous():
        # the kernels read the slots as a packed array; an engine's block-table column is strided
        state_indices, bind = state_indices.contiguous(), None
    if intermediate_states is not None:
        checks.expect_shape("intermediate_states", intermediate_states, (N, T, HV, V, K), "[N, T, HV, V, K]")
        if intermediate_states.dtype != state_pool.dtype:
            raise TypeError(f"intermediate_states has dtype {intermediate_states.dtype}; "
                            f"it must match the pool's {state_pool.dtype}")
        checks.expect_contiguous("intermediate_states", intermediate_states)
    if out is None:
        out = torch.empty(N, T, HV, V, dtype=q.dtype, device=q.device)
    else:
        checks.expect_shape("out", out, (N, T, HV, V), "v's shape")
        if out.dtype != q.dtype:
            raise TypeError(f"out has dtype {out.dtype}; it must match q's {q.dtype}")
        checks.expect_contiguous("out", out)
    scale = K**-0.5 if scale is None else scale

    fwd = backend.kernel_entry("decode", _decode_kernel, q.device, K, V, q.dtype)
    if fwd is not None:
        fwd(q, k, v, a, b, A_log, dt_bias, state_pool=state_pool, state_indices=state_indices, scale=scale,
            use_qk_l2norm=use_qk_l2norm_in_kernel, out=out, intermediate_states=intermediate_states,
            inplace_final_state=inplace_final_state, min_slot=min_slot,
            token_strides=(st_q, st_k, st_v, st_a, st_b), bind=bind)
    else:
        live = state_indices >= max(min_slot, 0)
        slots = state_indices.long().clamp(min=0)
        init = torch.where(live.view(-1, 1, 1, 1), state_pool[slots].float(), 0.0)
        o, states = recurrent_decode_ref(q, k, v, a, b, A_log, dt_bias, init, scale=scale,
                                         use_qk_l2norm=use_qk_l2norm_in_kernel, dtype=torch.float32)
        out.copy_(torch.where(live.view(-1, 1, 1, 1), o, 0.0))
        if intermediate_states is not None:
            rows = live.nonzero().squeeze(1)
            intermediate_states[rows] = states[rows].to(intermediate_states.dtype)
        if inplace_final_state:
            state_pool[slots[live]] = states[live, -1].to(state_pool.dtype)
    return out.squeeze(1) if single else out


__all__ = ["gated_delta_rule_decode"]
