"""Chunked gated-delta-rule prefill forward for SM90: a batch's static configuration, its two
kernels (from a precompiled library, else compiled with TileLang, once per configuration), warm-up
and launch on the plan's work items. The kernels themselves, and what they compute, are
:mod:`~.chunk_prefill_program`.
"""

import threading

import torch

from ..constants import CHUNK_SIZE as CHUNK
from ..constants import HEAD_DIM, LOG_DECAY_THRESHOLD
from . import library
from .chunk_prefill_program import (  # noqa: F401 - the builders: this module's API too
    PrefillStaticConfig,
    _build_chunk_fwd,
    _build_prep,
    _compile_set,
)

_TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

_lock = threading.Lock()
_kernels: dict = {}
_compile_count = 0


def compile_count() -> int:
    """Number of static configurations compiled with TileLang in this process (each one is two kernels:
    prep and chunk_fwd; library loads not counted)."""
    return _compile_count



def _kernel_set(cfg: PrefillStaticConfig):
    """The two kernels of ``cfg`` (``prep``, ``chunk_fwd``), once per process: from a
    precompiled library (:mod:`~.library`) when one holds both, else compiled with TileLang
    (which also caches on disk)."""
    global _compile_count
    ks = _kernels.get(cfg)
    if ks is not None:
        return ks
    with _lock:
        ks = _kernels.get(cfg)
        if ks is not None:
            return ks
        prep, fwd = library.lookup("prep", cfg), library.lookup("chunk_fwd", cfg)
        if prep is None or fwd is None:
            prep, fwd = _compile_set(cfg, library.tilelang_for(f"prefill kernels {cfg}"))
            _compile_count += 1
        ks = (prep, fwd)
        _kernels[cfg] = ks
        return ks


def static_config(q, v, beta, state_pool, use_qk_l2norm: bool) -> PrefillStaticConfig:
    return PrefillStaticConfig(
        num_qk_heads=q.shape[1], num_v_heads=v.shape[1], dtype=_TORCH_TO_TL[q.dtype],
        beta_dtype=_TORCH_TO_TL[beta.dtype], pool_dtype=_TORCH_TO_TL[state_pool.dtype],
        use_qk_l2norm=bool(use_qk_l2norm),
    )


def packed_config(num_qk_heads: int, num_v_heads: int, dtype: torch.dtype, pool_dtype: torch.dtype,
                  gate_dtypes: tuple[torch.dtype, torch.dtype]) -> PrefillStaticConfig:
    """The static configuration of the packed-inputs kernels (q, k, v read in the engine's conv
    output, the gates made from a and b with ``A_log`` and ``dt_bias`` of ``gate_dtypes``); beta is
    made in float32 inside, and q and k are normalised inside."""
    return PrefillStaticConfig(num_qk_heads, num_v_heads, _TORCH_TO_TL[dtype], "float32", _TORCH_TO_TL[pool_dtype],
                               True, tuple(_TORCH_TO_TL[d] for d in gate_dtypes))


def warmup(num_qk_heads: int, num_v_heads: int, *, dtype=torch.bfloat16, beta_dtype=None,
           pool_dtype=torch.float32, use_qk_l2norm: bool = True, packed_gate_dtypes=None) -> None:
    """Load (from a precompiled library) or compile one static configuration up front.

    Args:
        num_qk_heads / num_v_heads: ``H`` and ``HV`` (``HV % H == 0``).
        dtype: activation dtype, torch.bfloat16 or torch.float16.
        beta_dtype: dtype of beta, torch.float32 or ``dtype`` (default: ``dtype``).
        pool_dtype: state pool dtype, torch.float32 or torch.bfloat16.
        use_qk_l2norm: whether the kernels L2-normalise q and k.
        packed_gate_dtypes: None for the classic inputs; ``(A_log dtype, dt_bias dtype)`` for the
            packed-inputs kernels (:func:`chunk_gated_delta_rule_fwd_packed`; beta_dtype and
            use_qk_l2norm do not apply).
    """
    if num_v_heads % num_qk_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_qk_heads={num_qk_heads}")
    _kernel_set(_warmup_config(num_qk_heads, num_v_heads, dtype, beta_dtype, pool_dtype, use_qk_l2norm,
                               packed_gate_dtypes))


def _warmup_config(num_qk_heads, num_v_heads, dtype, beta_dtype, pool_dtype, use_qk_l2norm,
                   packed_gate_dtypes=None) -> PrefillStaticConfig:
    if packed_gate_dtypes is not None:
        return packed_config(num_qk_heads, num_v_heads, dtype, pool_dtype, packed_gate_dtypes)
    beta_dtype = dtype if beta_dtype is None else beta_dtype
    return PrefillStaticConfig(num_qk_heads, num_v_heads, _TORCH_TO_TL[dtype], _TORCH_TO_TL[beta_dtype],
                               _TORCH_TO_TL[pool_dtype], bool(use_qk_l2norm))


def missing(num_qk_heads: int, num_v_heads: int, *, dtype=torch.bfloat16, beta_dtype=None,
            pool_dtype=torch.float32, use_qk_l2norm: bool = True, packed_gate_dtypes=None) -> list[str]:
    """The kernels :func:`warmup` (same arguments) needs that no precompiled library holds."""
    cfg = _warmup_config(num_qk_heads, num_v_heads, dtype, beta_dtype, pool_dtype, use_qk_l2norm, packed_gate_dtypes)
    if cfg in _kernels:
        return []
    return [f"{kind} {cfg}" for kind in ("prep", "chunk_fwd") if not library.has(kind, cfg)]


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
    assert q.shape[2] == HEAD_DIM and v.shape[2] == HEAD_DIM and k.shape == q.shape and out.shape == v.shape
    if q.shape[0] == 0 or plan.num_seqs == 0:
        _launch_empty(plan, state_pool, state_indices, has_initial_state)
        return
    cfg = static_config(q, v, beta, state_pool, use_qk_l2norm)
    _launch(cfg, _kernel_set(cfg), (q, k, g, beta), (q, k, v), q.shape[0], scale=scale, plan=plan, state_pool=state_pool,
            state_indices=state_indices, has_initial_state=has_initial_state, checkpoints=checkpoints, out=out)


def chunk_gated_delta_rule_fwd_packed(qkv, a, b, A_log, dt_bias, *, num_qk_heads: int, a_stride: int,
                                      b_stride: int, scale: float, plan, state_pool, state_indices,
                                      has_initial_state, checkpoints=None, out, bind: dict | None = None) -> None:
    """The same prefill on the engine's own buffers, read in place: no pass splits, normalises or
    gates them first. No host sync, no per-shape compile.

    Args:
        qkv: ``[T, (2H + HV) K]`` bf16 or fp16, rows contiguous (the conv output: q's ``H K``
            columns, then k's, then v's ``HV V``); q and k raw (normalised inside, eps 1e-6).
        a, b: the gate inputs, token ``t`` value head ``h`` at ``a_stride * t + h`` (``b_stride``
            for b) from the tensors' first element, qkv's dtype; ``g = -exp(A_log) softplus(a +
            dt_bias)`` (softplus linear above 20), ``beta = sigmoid(b)``, in float32.
        A_log, dt_bias: ``[HV]``, float32 or the activation dtype.
        num_qk_heads: ``H`` (``HV`` is out's).
        scale, plan, state_pool, state_indices, has_initial_state, checkpoints: as
            :func:`chunk_gated_delta_rule_fwd`.
        out: ``[T, HV, V]`` contiguous, qkv's dtype; fully written.
        bind: a dict that receives, as ``bind["prefill"]``, this call as a :class:`BoundPrefill`
            taking the addresses of qkv, a, b, A_log, dt_bias, state_pool and out
            (:data:`PREFILL_BOUND_INPUTS`): another layer's tensors of the same shapes, strides
            and dtypes, with this plan, state_indices and has_initial_state, run with it alone.
            Library kernels without checkpoints only; left untouched otherwise.
    """
    T_, HV = qkv.shape[0], out.shape[1]
    if T_ == 0 or plan.num_seqs == 0:
        _launch_empty(plan, state_pool, state_indices, has_initial_state)
        return
    H = num_qk_heads
    cfg = packed_config(H, HV, qkv.dtype, state_pool.dtype, (A_log.dtype, dt_bias.dtype))
    kernels = _kernel_set(cfg)
    span_device = qkv.device if isinstance(kernels[0], library.LibraryKernel) else None
    flat = [library.launch_arg(x, ((T_ - 1) * st + HV,), (1,), span_device) for x, st in ((a, a_stride), (b, b_stride))]
    _launch(cfg, kernels, (qkv, *flat, A_log, dt_bias, int(a_stride), int(b_stride)), (qkv, qkv, qkv), T_, scale=scale,
            plan=plan, state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
            checkpoints=checkpoints, out=out, bind=bind)


# The tensors whose addresses a bound packed prefill takes, in order (``bind`` above).
PREFILL_BOUND_INPUTS = ("qkv", "a", "b", "A_log", "dt_bias", "state_pool", "out")


class BoundPrefill:
    """A packed prefill call with everything fixed but the layer's own tensors: prep and
    chunk_fwd bound to the step's plan, slots, flags and workspaces (kept alive here), and, where
    AutoCP splits a sequence, the start-state snapshot refreshed from the layer's pool first."""

    __slots__ = ("prep", "fwd", "snapshot", "state_indices", "_keep")

    def __init__(self, prep: library.BoundKernel, fwd: library.BoundKernel, snapshot, state_indices, keep: tuple):
        # keep: the other tensors whose addresses the launches hold (the plan's tables, the workspaces)
        self.prep, self.fwd, self.snapshot, self.state_indices, self._keep = prep, fwd, snapshot, state_indices, keep

    def __call__(self, ptrs, state_pool: torch.Tensor) -> None:
        """Run on ``ptrs`` (the addresses of :data:`PREFILL_BOUND_INPUTS`); ``state_pool`` is the
        layer's pool (its address is ``ptrs[5]``), read for the snapshot."""
        if self.snapshot is not None:
            torch.index_select(state_pool, 0, self.state_indices, out=self.snapshot)
        self.prep(ptrs)
        self.fwd(ptrs)


_unused_checkpoints: dict[tuple, torch.Tensor] = {}


def _unused_checkpoint(num_v_heads: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-row checkpoint buffer the kernel is given, and never writes, when a batch has no
    checkpoints (its argument cannot be empty); one per head count, dtype and device."""
    key = (num_v_heads, dtype, device)
    buf = _unused_checkpoints.get(key)
    if buf is None:
        buf = _unused_checkpoints[key] = torch.empty(1, num_v_heads, HEAD_DIM, HEAD_DIM, dtype=dtype, device=device)
    return buf


def _launch_empty(plan, state_pool, state_indices, has_initial_state) -> None:
    """A batch of no tokens: each final state is its initial state, or zeros without one."""
    if plan.num_seqs:
        idx = state_indices.long()
        state_pool[idx] = torch.where(has_initial_state.view(-1, 1, 1, 1), state_pool[idx], 0).to(state_pool.dtype)


def _launch(cfg: PrefillStaticConfig, kernels, prep_inputs: tuple, fwd_inputs: tuple, T_: int, *, scale, plan,
            state_pool, state_indices, has_initial_state, checkpoints, out, bind: dict | None = None) -> dict:
    """Runs ``kernels`` (``cfg``'s prep and chunk_fwd) on a batch of ``T_ > 0`` tokens: ``prep``
    gets ``prep_inputs`` before the plan's tables and workspaces, ``chunk_fwd`` gets ``fwd_inputs``
    (its q, k, v) before them. Returns the workspaces (t_beta, g_cum, qk_rnorm) for stage tests.
    ``bind``: the packed entry's (its prep inputs are :data:`PREFILL_BOUND_INPUTS`' first five)."""
    H, HV = cfg.num_qk_heads, cfg.num_v_heads
    assert HV % H == 0 and out.shape == (T_, HV, HEAD_DIM) and _TORCH_TO_TL[out.dtype] == cfg.dtype
    dt = out.dtype
    dev = out.device
    prep, fwd = kernels
    # Workspaces: the caching allocator serves these without a sync and inside graph capture.
    NC = plan.num_chunks
    t_beta = torch.empty(NC, HV, CHUNK, CHUNK, dtype=dt, device=dev)
    g_cum = torch.empty(NC, HV, CHUNK, dtype=torch.float32, device=dev)
    qk_rnorm = torch.empty(NC, H, 2, CHUNK, dtype=torch.float32, device=dev)
    every = plan.checkpoint_every or 0
    if checkpoints is None or every == 0 or checkpoints.shape[0] == 0:
        ckpt, every_chunks = _unused_checkpoint(HV, state_pool.dtype, dev), 0
    else:
        ckpt, every_chunks = checkpoints, every // CHUNK
    cu = plan.cu_seqlens
    items = plan.work_items
    # A library kernel reads pointers and shapes: spans instead of views (no torch op).
    span_device = dev if isinstance(fwd, library.LibraryKernel) else None
    flat_pool = library.pool_arg(state_pool, span_device)
    h0_pool, h0_slots, h0_stride = flat_pool, state_indices, state_pool.stride(0)
    snapshot = None
    if plan.context_parallel is not None:
        # Several work items of one sequence run at once and the last one writes the final
        # state into the slot the others read their start state from: they read a snapshot.
        # (index_select takes the int32 indices as they are: no cast kernel)
        snapshot = torch.index_select(state_pool, 0, state_indices)
        h0_stride = snapshot.stride(0)
        h0_pool = library.launch_arg(snapshot, (snapshot.numel(),), (1,), span_device)
        h0_slots = plan.seq_ids
    # (the kernel takes the flags as uint8: a view of another dtype, which as_strided cannot give)
    has_initial = (library.Span(has_initial_state.data_ptr(), tuple(has_initial_state.shape), dev)
                   if span_device is not None else has_initial_state.view(torch.uint8))
    prep_args = (*prep_inputs, plan.chunk_bounds, t_beta, g_cum, qk_rnorm)
    fwd_args = (*fwd_inputs, t_beta, g_cum, qk_rnorm, cu, plan.chunk_offsets, items, plan.checkpoint_offsets,
                has_initial, h0_slots, h0_pool, h0_stride, state_indices, flat_pool,
                state_pool.stride(0), every_chunks, ckpt, float(LOG_DECAY_THRESHOLD), float(scale), out)
    prep(*prep_args)
    fwd(*fwd_args)
    if bind is not None and every_chunks == 0 and span_device is not None and isinstance(prep, library.LibraryKernel):
        # argument position -> PREFILL_BOUND_INPUTS index: qkv, a, b, A_log, dt_bias for prep;
        # qkv (as q, k and v), the pool (flat, and as the start states without a snapshot), out
        fwd_slots = {0: 0, 1: 0, 2: 0, 15: 5, 21: 6}
        if snapshot is None:
            fwd_slots[12] = 5
        bind["prefill"] = BoundPrefill(
            prep.bind(prep_args, {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}), fwd.bind(fwd_args, fwd_slots), snapshot,
            state_indices, keep=(plan, t_beta, g_cum, qk_rnorm, ckpt, has_initial_state))
    return dict(t_beta=t_beta, g_cum=g_cum, qk_rnorm=qk_rnorm)
