"""Chunked prefill of the gated delta rule: FLA-compatible API and the serving (pool) form.

Both run the TileLang kernels where :mod:`qla_serving.backend` allows, and otherwise the
float32 chunked reference (:mod:`.naive`), saying so once in the log.
"""

from __future__ import annotations

import torch

from ... import backend
from ...constants import HEAD_DIM
from ...plan import PrefillPlan, plan_prefill
from . import checks
from .naive import CHUNK_SIZE, chunk_gated_delta_rule_ref, gdn_gate_ref


def _plan_for(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu, T: int, device, checkpoint_every,
              num_v_heads: int) -> PrefillPlan:
    if cu_seqlens_cpu is None:
        # Only the FLA-compatible path gets here without a plan: one sync to read the offsets.
        cu_seqlens_cpu = cu_seqlens.cpu() if cu_seqlens is not None else torch.tensor([0, T])
    return plan_prefill(cu_seqlens_cpu, device=device, checkpoint_every=checkpoint_every, num_v_heads=num_v_heads)


def _check_prefill_inputs(q, k, v, g, beta, T: int):
    """Validate flat ``[T, ...]`` inputs; returns ``(H, HV, K, V)``."""
    checks.expect_rank("q", q, (3,), "[T, H, K]")
    H, K = q.shape[1], q.shape[2]
    checks.expect_shape("k", k, (T, H, K), "[T, H, K], like q")
    checks.expect_rank("v", v, (3,), "[T, HV, V]")
    HV, V = v.shape[1], v.shape[2]
    if v.shape[0] != T:
        raise ValueError(f"v has {v.shape[0]} tokens but q has {T}")
    checks.expect_heads(H, HV)
    checks.expect_shape("g", g, (T, HV), "[T, HV], one log-decay per token and value head")
    checks.expect_shape("beta", beta, (T, HV), "[T, HV], one write strength per token and value head")
    checks.expect_dtype("q", q, checks.ACTIVATION_DTYPES)
    checks.expect_same_dtype("q", q, k=k, v=v)
    gate_dtypes = (torch.float32, q.dtype)
    checks.expect_dtype("g", g, gate_dtypes)
    checks.expect_dtype("beta", beta, gate_dtypes)
    checks.expect_same_device(q.device, k=k, v=v, g=g, beta=beta)
    checks.expect_contiguous_all(q=q, k=k, v=v)
    return H, HV, K, V


def _flatten_batch(name: str, x: torch.Tensor, rank: int, layout: str) -> torch.Tensor:
    """``[1, T, ...]`` or ``[T, ...]`` -> ``[T, ...]``."""
    checks.expect_rank(name, x, (rank, rank + 1), layout)
    if x.dim() == rank + 1:
        if x.shape[0] != 1:
            raise ValueError(f"{name} has batch dim {x.shape[0]}; the varlen form takes [1, T, ...] or [T, ...]")
        x = x[0]
    return x


def _all_initial(plan: PrefillPlan, device: torch.device) -> torch.Tensor:
    """``[N]`` True on ``device``, made once per plan (every layer of the batch passes the same,
    and the kernels only read it), not allocated and filled again in every layer."""
    ones = plan.extras.get("_all_initial")
    if ones is None or ones.device != device:
        ones = torch.ones(plan.num_seqs, dtype=torch.bool, device=device)
        plan.extras["_all_initial"] = ones
    return ones


_kernel_module = None


def _prefill_module():
    """The TileLang chunked prefill's host module (imported on first use: TileLang loads only where
    it runs; then the module is kept, an attribute read per call instead of an import statement)."""
    global _kernel_module
    if _kernel_module is None:
        from ...kernels import chunk_prefill

        _kernel_module = chunk_prefill
    return _kernel_module


def _prefill_kernels():
    """The chunked prefill's entry point for contiguous q, k, v and given gates."""
    return _prefill_module().chunk_gated_delta_rule_fwd


def _prefill_packed_kernels():
    """Its entry point for the engine's conv output and raw gate inputs."""
    return _prefill_module().chunk_gated_delta_rule_fwd_packed


def _run_prefill(q, k, v, g, beta, *, scale, plan, state_pool, state_indices, has_initial_state,
                 use_qk_l2norm, checkpoints, out) -> None:
    """Run on validated flat inputs; updates ``state_pool``/``checkpoints``/``out`` in place."""
    fwd = backend.kernel_entry("prefill", _prefill_kernels, q.device, q.shape[2], v.shape[2], q.dtype)
    if fwd is not None:
        fwd(q, k, v, g.float() if g.dtype != torch.float32 else g, beta, scale=scale, plan=plan,
            state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
            use_qk_l2norm=use_qk_l2norm, checkpoints=checkpoints, out=out)
        return
    idx = state_indices.long()
    init = torch.where(has_initial_state.view(-1, 1, 1, 1), state_pool[idx].float(), 0.0)
    o, final, ckpt = chunk_gated_delta_rule_ref(
        q, k, v, g, beta, scale=scale, initial_state=init, cu_seqlens=plan.cu_seqlens_cpu,
        use_qk_l2norm=use_qk_l2norm, checkpoint_every=plan.checkpoint_every,
    )
    out.copy_(o)
    state_pool[idx] = final.to(state_pool.dtype)
    if checkpoints is not None:
        checkpoints.copy_(ckpt)


def chunk_gated_delta_rule_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    plan: PrefillPlan | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    checkpoints: torch.Tensor | None = None,
    checkpoint_every: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill a varlen batch with the state living in the engine's pool, updated in place.

    Args:
        q: ``[1, T, H, K]`` or ``[T, H, K]``, bf16/fp16 (fp32 runs the reference) — queries
            of all sequences, concatenated along T. Contiguous.
        k: same shape and dtype as ``q`` — keys.
        v: ``[1, T, HV, V]`` or ``[T, HV, V]``, q's dtype — values; ``HV`` a multiple of ``H``.
        g: ``[1, T, HV]`` or ``[T, HV]``, float32 (or q's dtype) — log-space decay (``<= 0``).
        beta: ``[1, T, HV]`` or ``[T, HV]``, float32 or q's dtype — write strength.
        state_pool: ``[num_slots, HV, V, K]`` float32 or bfloat16 — the engine's state pool,
            ``[HV, V, K]`` contiguous per slot, any slot stride. Read at ``state_indices`` and
            overwritten there with each sequence's final state. Other slots are not touched.
        state_indices: ``[N]`` int32/int64, any stride (a strided one is copied first) — the pool
            slot of each sequence, distinct.
        cu_seqlens: ``[N + 1]`` int32/int64 on q's device — sequence offsets along T. Not
            needed when ``plan`` is given.
        has_initial_state: ``[N]`` bool — read the slot (True) or start from zeros (False);
            None means all True.
        scale: output scale, ``K ** -0.5`` when None.
        use_qk_l2norm_in_kernel: L2-normalise q and k inside the op.
        plan: the batch's :class:`~qla_serving.plan.PrefillPlan` (built once per batch on the
            host, shared by every layer). Without it the op builds one, reading
            ``cu_seqlens_cpu`` or else syncing once to read ``cu_seqlens``.
        cu_seqlens_cpu: ``[N + 1]`` CPU offsets, used to build the plan when none is given.
        checkpoints: ``[plan.num_checkpoints, HV, V, K]`` in the pool's dtype, or None —
            receives the state after every ``checkpoint_every`` tokens of each sequence,
            sequence by sequence (rows ``plan.checkpoint_offsets[i]:...[i + 1]``).
        checkpoint_every: tokens between checkpoints, a multiple of 64 (only without ``plan``;
            a plan carries its own).
        out: optional ``[T, HV, V]`` output buffer in q's dtype.

    Returns:
        ``o``: ``[1, T, HV, V]`` or ``[T, HV, V]`` (q's batch form), q's dtype.
    """
    batched = q.dim() == 4
    q = _flatten_batch("q", q, 3, "[1, T, H, K] or [T, H, K]")
    k = _flatten_batch("k", k, 3, "[1, T, H, K] or [T, H, K]")
    v = _flatten_batch("v", v, 3, "[1, T, HV, V] or [T, HV, V]")
    g = _flatten_batch("g", g, 2, "[1, T, HV] or [T, HV]")
    beta = _flatten_batch("beta", beta, 2, "[1, T, HV] or [T, HV]")
    T = q.shape[0]
    H, HV, K, V = _check_prefill_inputs(q, k, v, g, beta, T)
    plan, state_indices, has_initial_state, out = _check_pool_call(
        T, HV, V, K, q.dtype, q.device, state_pool, state_indices, cu_seqlens, cu_seqlens_cpu, has_initial_state,
        plan, checkpoints, checkpoint_every, out, "q")
    _run_prefill(q, k, v, g, beta, scale=K**-0.5 if scale is None else scale, plan=plan,
                 state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
                 use_qk_l2norm=use_qk_l2norm_in_kernel, checkpoints=checkpoints, out=out)
    return out.unsqueeze(0) if batched else out


def _check_pool_call(T, HV, V, K, dtype, device, state_pool, state_indices, cu_seqlens, cu_seqlens_cpu,
                     has_initial_state, plan, checkpoints, checkpoint_every, out, tokens_of: str):
    """The pool forms' common arguments checked (and the plan built when none is given); returns
    ``(plan, state_indices, has_initial_state, out)`` with the defaults filled in (the index and flag
    tensors packed: copies of strided ones). ``tokens_of``: the input that
    gives the token count ``T``, for the messages."""
    checks.expect_pool("state_pool", state_pool, HV, V, K)
    checks.expect_same_device(device, state_pool=state_pool, state_indices=state_indices,
                              cu_seqlens=cu_seqlens, has_initial_state=has_initial_state,
                              checkpoints=checkpoints, out=out)
    if plan is None:
        if cu_seqlens is None and cu_seqlens_cpu is None:
            raise ValueError("give plan, cu_seqlens or cu_seqlens_cpu: the pool form is varlen")
        plan = _plan_for(cu_seqlens, cu_seqlens_cpu, T, device, checkpoint_every, HV)
    elif checkpoint_every is not None and checkpoint_every != plan.checkpoint_every:
        raise ValueError(f"checkpoint_every={checkpoint_every} disagrees with the plan's {plan.checkpoint_every}")
    if plan.total_tokens != T:
        raise ValueError(f"the plan covers {plan.total_tokens} tokens but {tokens_of} has {T}")
    N = plan.num_seqs
    checks.expect_slots("state_indices", state_indices, state_pool.shape[0], N, allow_padding=False)
    if has_initial_state is None:
        has_initial_state = _all_initial(plan, device)
    checks.expect_shape("has_initial_state", has_initial_state, (N,), "[N] bool")
    checks.expect_dtype("has_initial_state", has_initial_state, (torch.bool,))
    # the kernels read both as packed arrays; an engine's block-table column is strided
    state_indices, has_initial_state = state_indices.contiguous(), has_initial_state.contiguous()
    if checkpoints is not None:
        if not plan.checkpoint_every:
            raise ValueError("checkpoints given but no checkpoint_every (in the plan or as an argument)")
        checks.expect_shape("checkpoints", checkpoints, (plan.num_checkpoints, HV, V, K),
                            "[num_checkpoints, HV, V, K]")
        if checkpoints.dtype != state_pool.dtype:
            raise TypeError(f"checkpoints has dtype {checkpoints.dtype}; it must match the pool's {state_pool.dtype}")
        checks.expect_contiguous("checkpoints", checkpoints)
    if out is None:
        out = torch.empty(T, HV, V, dtype=dtype, device=device)
    else:
        checks.expect_shape("out", out, (T, HV, V), "[T, HV, V]")
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype}; it must match the activations' {dtype}")
        checks.expect_contiguous("out", out)
    return plan, state_indices, has_initial_state, out


def _gate_input(name: str, x: torch.Tensor, T: int, HV: int) -> tuple[torch.Tensor, int]:
    """A gate input ``[T, HV]`` and its token stride: read in place when ``HV`` is contiguous per
    token (a column range of the engine's gate projection qualifies), else a contiguous copy."""
    checks.expect_shape(name, x, (T, HV), "[T, HV]")
    if HV > 1 and x.stride(1) != 1 or T > 1 and x.stride(0) < HV:
        x = x.contiguous()
    return x, (x.stride(0) if T > 1 else HV)


def chunk_gated_delta_rule_pool_packed(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    num_qk_heads: int,
    cu_seqlens: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    plan: PrefillPlan | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    checkpoints: torch.Tensor | None = None,
    checkpoint_every: int | None = None,
    out: torch.Tensor | None = None,
    bind: dict | None = None,
) -> torch.Tensor:
    """:func:`chunk_gated_delta_rule_pool` on the engine's own buffers: the conv output holding q,
    k and v, and the raw gate inputs. The kernels read them in place and make the gates and the
    q/k L2 norm themselves, so that no pass splits, normalises and gates them first.

    Args:
        qkv: ``[T, (2 H + HV) K]`` bf16/fp16 (fp32 runs the reference) — the GDN layer's conv
            output: q's ``H K`` columns, then k's ``H K``, then v's ``HV V``, K = V = 128; q and
            k raw (L2-normalised inside, eps 1e-6). Read in place when its rows are contiguous
            and it starts 16-byte aligned; copied otherwise.
        a: ``[T, HV]``, qkv's dtype — decay input: ``g = -exp(A_log) * softplus(a + dt_bias)``
            (softplus linear above 20), float32. Read in place when ``HV`` is contiguous per
            token (any token stride, e.g. a column range of the gate projection).
        b: ``[T, HV]``, qkv's dtype — write-strength input: ``beta = sigmoid(b)``; a's layout rule.
        A_log: ``[HV]`` float32 or qkv's dtype — per-head log decay rate.
        dt_bias: ``[HV]`` float32 or qkv's dtype — per-head bias of ``a``.
        state_pool, state_indices, cu_seqlens, has_initial_state, scale, plan, cu_seqlens_cpu,
            checkpoints, checkpoint_every: as :func:`chunk_gated_delta_rule_pool`.
        num_qk_heads: ``H``; ``HV`` is ``A_log``'s length, a multiple of ``H``.
        out: optional ``[T, HV, V]`` output buffer in qkv's dtype, contiguous.
        bind: optional dict that receives ``bind["prefill"]``, this call bound to everything but
            the addresses of qkv, a, b, A_log, dt_bias, state_pool and out
            (``qla_serving.kernels.chunk_prefill.PREFILL_BOUND_INPUTS``; called with them and the
            pool): for the same call on another layer's tensors of identical shapes, strides and
            dtypes with this plan, state_indices and has_initial_state (an engine's later GDN
            layers of a step), without the checks. Set only where the kernels read every input in
            place from a precompiled library, without checkpoints.

    Returns:
        ``o``: ``[T, HV, V]``, qkv's dtype.
    """
    checks.expect_rank("qkv", qkv, (2,), "[T, (2H + HV) K]")
    checks.expect_rank("A_log", A_log, (1,), "[HV]")
    T, H, HV = qkv.shape[0], num_qk_heads, A_log.shape[0]
    checks.expect_heads(H, HV)
    K = V = HEAD_DIM
    if qkv.shape[1] != (2 * H + HV) * K:
        raise ValueError(f"qkv has {qkv.shape[1]} columns; {H} q/k and {HV} value heads of {K} make "
                         f"(2 * {H} + {HV}) * {K} = {(2 * H + HV) * K}")
    checks.expect_dtype("qkv", qkv, checks.ACTIVATION_DTYPES)
    checks.expect_shape("dt_bias", dt_bias, (HV,), "[HV]")
    for name, x in (("a", a), ("b", b)):
        if x.dtype != qkv.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}; it must match qkv's {qkv.dtype}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        checks.expect_dtype(name, x, (torch.float32, qkv.dtype))
    checks.expect_same_device(qkv.device, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    given = (qkv, a, b)
    a, a_stride = _gate_input("a", a, T, HV)
    b, b_stride = _gate_input("b", b, T, HV)
    if qkv.stride(-1) != 1 or T > 1 and qkv.stride(0) != qkv.shape[1] or qkv.data_ptr() % 16:
        qkv = qkv.contiguous()
    if bind is not None and any(x is not y for x, y in zip((qkv, a, b), given)):
        bind = None  # a launch bound to a copy would read this call's copy in every later call
    given_slots = (state_indices, has_initial_state)
    plan, state_indices, has_initial_state, out = _check_pool_call(
        T, HV, V, K, qkv.dtype, qkv.device, state_pool, state_indices, cu_seqlens, cu_seqlens_cpu, has_initial_state,
        plan, checkpoints, checkpoint_every, out, "qkv")
    if bind is not None and (given_slots[0] is not state_indices
                             or given_slots[1] is not None and given_slots[1] is not has_initial_state):
        bind = None  # (the packed copies of strided slots or flags: the same reason)
    scale = K**-0.5 if scale is None else scale
    fwd = backend.kernel_entry("prefill", _prefill_packed_kernels, qkv.device, K, V, qkv.dtype)
    if fwd is not None:
        fwd(qkv, a, b, A_log, dt_bias, num_qk_heads=H, a_stride=a_stride, b_stride=b_stride, scale=scale, plan=plan,
            state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
            checkpoints=checkpoints, out=out, bind=bind)
        return out
    q, k, v = (x.contiguous() for x in qkv.split([H * K, H * K, HV * V], dim=-1))
    g, beta = gdn_gate_ref(a, b, A_log, dt_bias, dtype=torch.float32)
    _run_prefill(q.view(T, H, K), k.view(T, H, K), v.view(T, HV, V), g, beta, scale=scale, plan=plan,
                 state_pool=state_pool, state_indices=state_indices, has_initial_state=has_initial_state,
                 use_qk_l2norm=True, checkpoints=checkpoints, out=out)
    return out


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    plan: PrefillPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA-compatible chunked gated delta rule (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``).

    Args:
        q: ``[B, T, H, K]`` bf16/fp16 (fp32 runs the reference) — queries.
        k: ``[B, T, H, K]``, q's dtype — keys.
        v: ``[B, T, HV, V]``, q's dtype — values; ``HV`` a multiple of ``H`` (GVA: value head
            ``i`` reads q/k head ``i // (HV // H)``).
        g: ``[B, T, HV]`` — log-space decay per token (``<= 0``), float32 or q's dtype.
        beta: ``[B, T, HV]`` — write strength, float32 or q's dtype.
        scale: output scale, ``K ** -0.5`` when None.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), any float
            dtype, or None for zeros. ``N = B``, or ``len(cu_seqlens) - 1`` in varlen mode.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: L2-normalise q and k inside the op.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets: varlen mode, which needs ``B == 1``.
        state_v_first: states in the engines' ``[N, HV, V, K]`` layout instead of FLA's.
        cu_seqlens_cpu: the same offsets on the CPU, to plan without a device->host sync.
        plan: a ready :class:`~qla_serving.plan.PrefillPlan` for this batch.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` float32 in
        the layout of ``initial_state`` (``[N, HV, K, V]`` or ``[N, HV, V, K]``), or None.
    """
    checks.expect_rank("q", q, (4,), "[B, T, H, K]")
    checks.expect_rank("k", k, (4,), "[B, T, H, K]")
    checks.expect_rank("v", v, (4,), "[B, T, HV, V]")
    checks.expect_rank("g", g, (3,), "[B, T, HV]")
    checks.expect_rank("beta", beta, (3,), "[B, T, HV]")
    B, T = q.shape[:2]
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if tuple(x.shape[:2]) != (B, T):
            raise ValueError(f"{name} has leading dims {tuple(x.shape[:2])} but q has (B, T) = {(B, T)}")
    varlen = cu_seqlens is not None or cu_seqlens_cpu is not None or plan is not None
    if varlen and B != 1:
        raise ValueError(f"varlen mode (cu_seqlens/plan) needs batch size 1, got B={B}")
    if not varlen:
        cu_seqlens_cpu = torch.arange(0, (B + 1) * T, T)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    flat = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    qf, kf, vf, gf, bf = flat
    if plan is None:
        if cu_seqlens is not None:
            checks.expect_rank("cu_seqlens", cu_seqlens, (1,), "[N + 1]")
            checks.expect_dtype("cu_seqlens", cu_seqlens, checks.INDEX_DTYPES)
            checks.expect_same_device(q.device, cu_seqlens=cu_seqlens)
        plan = _plan_for(cu_seqlens, cu_seqlens_cpu, B * T, q.device, None, HV)
    N = plan.num_seqs
    if initial_state is not None:
        layout = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
        checks.expect_rank("initial_state", initial_state, (4,), layout)
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        checks.expect_shape("initial_state", initial_state, want, layout)
        checks.expect_same_device(q.device, initial_state=initial_state)
        if not initial_state.dtype.is_floating_point:
            raise TypeError(f"initial_state must be a float tensor, got {initial_state.dtype}")
    # The op updates its pool in place: a private float32 copy, so the caller's tensor is untouched.
    if initial_state is None:
        pool = torch.zeros(N, HV, V, K, dtype=torch.float32, device=q.device)
    else:
        pool = torch.empty(N, HV, V, K, dtype=torch.float32, device=q.device)
        pool.copy_(initial_state if state_v_first else initial_state.transpose(-1, -2))
    o = chunk_gated_delta_rule_pool(
        qf, kf, vf, gf, bf, pool, torch.arange(N, dtype=torch.int32, device=q.device),
        has_initial_state=torch.full((N,), initial_state is not None, dtype=torch.bool, device=q.device),
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, plan=plan,
    )
    final = None
    if output_final_state:
        final = pool if state_v_first else pool.transpose(-1, -2).contiguous()
    return o.view(B, T, HV, V), final


__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_pool", "CHUNK_SIZE"]
