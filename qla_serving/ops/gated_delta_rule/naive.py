"""Exact PyTorch references for the gated delta rule; they run on any device, the CPU included.

Two references, side by side with the fast paths (as FLA keeps ``naive.py``):

* :func:`recurrent_gated_delta_rule_ref` — the oracle: token by token, float64.
* :func:`chunk_gated_delta_rule_ref` — float32, the 64-token WY decomposition the prefill
  kernels implement (``docs/design.md``). It is the readable spec of the kernels and can
  return every intermediate so a kernel stage can be checked on its own.

Both take flat varlen inputs (``[T, H, K]`` with ``cu_seqlens``) and keep the state in the
engines' layout ``[N, HV, V, K]``; the op layer converts shapes and layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ...constants import CHUNK_SIZE, L2NORM_EPS, LOG_DECAY_THRESHOLD, SOFTPLUS_THRESHOLD

if TYPE_CHECKING:  # the plan's type only: the planner is the layer above the references
    from ...plan import ContextParallelPlan


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim (FLA's definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gate_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, dtype=torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode gate, ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.

    Args:
        a: ``[..., HV]``, any float dtype — the per-token decay input.
        b: ``[..., HV]``, any float dtype — the per-token write-strength input.
        A_log: ``[HV]`` — the per-head log decay rate.
        dt_bias: ``[HV]`` — the per-head bias added to ``a``.
        dtype: the dtype of the computation and of the results.

    Returns:
        ``(g, beta)``, both ``[..., HV]`` in ``dtype``. Softplus uses threshold 20, as the
        engines' ``fused_gdn_gating`` does.
    """
    x = a.to(dtype) + dt_bias.to(dtype)
    g = -torch.exp(A_log.to(dtype)) * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    return g, torch.sigmoid(b.to(dtype))


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """``[T, H, D] -> [T, HV, D]``: value head ``i`` reads q/k head ``i // (HV // H)``."""
    return x.repeat_interleave(hv // x.shape[1], dim=1)


def _seq_bounds(cu_seqlens: torch.Tensor | None, total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def num_checkpoints(length: int, every: int | None) -> int:
    """Checkpoints a sequence of ``length`` tokens writes: the states after ``every, 2*every, ...``."""
    return 0 if not every else length // every


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    checkpoint_every: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule: the oracle every other path is judged by.

    Args:
        q, k: ``[T, H, K]`` — queries and keys of all sequences, concatenated.
        v: ``[T, HV, V]`` — values; ``HV`` a multiple of ``H``.
        g: ``[T, HV]`` — log-space decay per token (``<= 0``).
        beta: ``[T, HV]`` — write strength per token.
        scale: output scale; ``K ** -0.5`` when None.
        initial_state: ``[N, HV, V, K]`` or None (zeros) — state before each sequence.
        cu_seqlens: ``[N + 1]`` integer offsets of the sequences in ``T``; None means one sequence.
        use_qk_l2norm: L2-normalise q and k first.
        checkpoint_every: if set, also return the state after every ``checkpoint_every`` tokens
            of each sequence, sequence by sequence.
        dtype: computation dtype (float64 for the oracle).

    Returns:
        ``(o [T, HV, V], final_state [N, HV, V, K], checkpoints [C, HV, V, K])`` in ``dtype``.
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k = _expand_heads(q, HV), _expand_heads(k, HV)
    bounds = _seq_bounds(cu_seqlens, T)
    o = torch.zeros(T, HV, V, dtype=dtype, device=q.device)
    finals, ckpts = [], []
    for n, (bos, eos) in enumerate(bounds):
        if initial_state is None:
            S = torch.zeros(HV, V, K, dtype=dtype, device=q.device)
        else:
            S = initial_state[n].to(dtype).clone()
        for t in range(bos, eos):
            S = S * torch.exp(g[t])[:, None, None]
            pred = torch.einsum("hvk,hk->hv", S, k[t])
            S = S + torch.einsum("hv,hk->hvk", (v[t] - pred) * beta[t][:, None], k[t])
            o[t] = torch.einsum("hvk,hk->hv", S, q[t]) * scale
            if checkpoint_every and (t - bos + 1) % checkpoint_every == 0:
                ckpts.append(S.clone())
        finals.append(S)
    ckpt = torch.stack(ckpts) if ckpts else torch.zeros(0, HV, V, K, dtype=dtype, device=q.device)
    return o, torch.stack(finals), ckpt


@dataclass
class ChunkIntermediates:
    """Per-chunk tensors of :func:`chunk_gated_delta_rule_ref`, chunks in sequence order.

    ``g_cum [NC, C, HV]``, ``w [NC, C, HV, K]``, ``u [NC, C, HV, V]``, ``v_new [NC, C, HV, V]``
    and ``h [NC, HV, V, K]`` (the state entering each chunk, engines' layout). A short last
    chunk is zero-padded to ``C`` rows.
    """

    g_cum: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    v_new: torch.Tensor
    h: torch.Tensor


def _pad_chunk(x: torch.Tensor, C: int) -> torch.Tensor:
    """Zero-pad the token dim to ``C``: exact, since padded rows have k = v = beta = g = 0."""
    n = x.shape[0]
    return F.pad(x, (0,) * (2 * (x.dim() - 1)) + (0, C - n)) if n < C else x


def chunk_state_pass(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, h: torch.Tensor,
                     chunk_size: int = CHUNK_SIZE) -> tuple[dict, torch.Tensor]:
    """The WY chunk pass over one span of one sequence, chunk by chunk (``docs/design.md``).

    Args:
        k: ``[L, HV, K]`` keys (normalised, expanded to the value heads).
        v: ``[L, HV, D]`` values (or zeros, with ``h`` the identity, for a span's transition).
        g, beta: ``[L, HV]``.
        h: ``[HV, K, D]`` the state entering the span, FLA layout (the transpose of ``S``).

    Returns:
        ``(per_chunk, h_end)``: ``per_chunk`` maps ``g_cum [NC, C, HV]``, ``w [NC, C, HV, K]``,
        ``u [NC, C, HV, D]``, ``v_new [NC, C, HV, D]`` and ``h [NC, HV, K, D]`` (entering
        states); ``h_end`` is the state after the span.
    """
    C = chunk_size
    dev, dt = h.device, h.dtype
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1)
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev))
    eye = torch.eye(C, dtype=dt, device=dev)
    out = {name: [] for name in ("g_cum", "w", "u", "v_new", "h")}
    for cs in range(0, k.shape[0], C):
        kc, vc = (_pad_chunk(x[cs:cs + C], C).transpose(0, 1) for x in (k, v))  # [HV, C, D]
        gc, bc = (_pad_chunk(x[cs:cs + C], C).transpose(0, 1) for x in (g, beta))  # [HV, C]
        G = gc.cumsum(-1)
        decay = torch.exp((G[:, :, None] - G[:, None, :]).masked_fill(~incl, float("-inf")))
        A = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0)
        Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
        w = Tinv @ (kc * (bc * torch.exp(G))[..., None])
        u = Tinv @ (vc * bc[..., None])
        v_new = u - w @ h
        for name, x in (("g_cum", G.T), ("w", w.transpose(0, 1)), ("u", u.transpose(0, 1)),
                        ("v_new", v_new.transpose(0, 1)), ("h", h)):
            out[name].append(x)
        G_last = G[:, -1]
        h = torch.exp(G_last)[:, None, None] * h + (kc * torch.exp(G_last[:, None] - G)[..., None]).transpose(-1, -2) @ v_new
    if not out["h"]:
        return {}, h
    return {name: torch.stack(x) for name, x in out.items()}, h


def chunk_output(q: torch.Tensor, k: torch.Tensor, per_chunk: dict, scale: float,
                 chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """``o = scale ((q exp(G)) h + lower_incl(q k^T exp(G_i - G_j)) v')`` for every chunk of a span.

    ``q, k``: ``[L, HV, K]`` (normalised, expanded); ``per_chunk`` from :func:`chunk_state_pass`.
    Returns ``o [L, HV, D]``.
    """
    C, L = chunk_size, q.shape[0]
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    o = []
    for c, cs in enumerate(range(0, L, C)):
        qc, kc = (_pad_chunk(x[cs:cs + C], C).transpose(0, 1) for x in (q, k))
        G = per_chunk["g_cum"][c].T
        decay = torch.exp((G[:, :, None] - G[:, None, :]).masked_fill(~incl, float("-inf")))
        attn = (qc @ kc.transpose(-1, -2)) * decay
        oc = ((qc * torch.exp(G)[..., None]) @ per_chunk["h"][c] + attn @ per_chunk["v_new"][c].transpose(0, 1)) * scale
        o.append(oc[:, :min(C, L - cs)].transpose(0, 1))
    return torch.cat(o) if o else q.new_zeros(0, q.shape[1], per_chunk.get("v_new", q).shape[-1])


def prepare_inputs(q, k, v, g, beta, use_qk_l2norm: bool, dtype: torch.dtype):
    """Cast to ``dtype``, L2-normalise q and k if asked, expand q and k to the value heads."""
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return _expand_heads(q, v.shape[1]), _expand_heads(k, v.shape[1]), v, g, beta


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    checkpoint_every: int | None = None,
    chunk_size: int = CHUNK_SIZE,
    return_intermediates: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """Chunked (WY) gated delta rule in float32 — the kernels' algorithm, written plainly.

    Arguments and results are those of :func:`recurrent_gated_delta_rule_ref`
    (``checkpoint_every`` must be a multiple of ``chunk_size``). With
    ``return_intermediates`` a fourth result, :class:`ChunkIntermediates`, is returned.
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    C = chunk_size
    if checkpoint_every and checkpoint_every % C:
        raise ValueError(f"checkpoint_every={checkpoint_every} must be a multiple of the chunk size {C}")
    scale = K**-0.5 if scale is None else scale
    dev = q.device
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, use_qk_l2norm, dtype)
    o = torch.zeros(T, HV, V, dtype=dtype, device=dev)
    finals, ckpts, inter = [], [], []
    for n, (bos, eos) in enumerate(_seq_bounds(cu_seqlens, T)):
        # h is the FLA layout [HV, K, V]; the engines' state is its transpose.
        h = (torch.zeros(HV, K, V, dtype=dtype, device=dev) if initial_state is None
             else initial_state[n].to(dtype).transpose(-1, -2))
        per_chunk, h_end = chunk_state_pass(k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], h, C)
        if not per_chunk:
            finals.append(h_end.transpose(-1, -2))
            continue
        o[bos:eos] = chunk_output(q[bos:eos], k[bos:eos], per_chunk, scale, C)
        # The state after chunk c is the state entering chunk c + 1 (or the final state).
        after = torch.cat([per_chunk["h"][1:], h_end[None]])
        if checkpoint_every:
            every = checkpoint_every // C
            full = (eos - bos) // C  # checkpoints sit at full-chunk boundaries only
            ckpts.extend(after[c].transpose(-1, -2) for c in range(every - 1, full, every))
        per_chunk["h"] = per_chunk["h"].transpose(-1, -2)
        inter.append(per_chunk)
        finals.append(h_end.transpose(-1, -2))
    ckpt = torch.stack(ckpts) if ckpts else torch.zeros(0, HV, V, K, dtype=dtype, device=dev)
    result = (o, torch.stack(finals), ckpt)
    if return_intermediates:
        shapes = {"g_cum": (0, C, HV), "w": (0, C, HV, K), "u": (0, C, HV, V), "v_new": (0, C, HV, V),
                  "h": (0, HV, V, K)}
        result += (ChunkIntermediates(**{
            name: torch.cat([x[name] for x in inter]) if inter else torch.zeros(shape, dtype=dtype, device=dev)
            for name, shape in shapes.items()}),)
    return result


def recurrent_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode oracle: ``T`` tokens for each of ``N`` sequences, gate computed from ``a, b``.

    Args:
        q, k: ``[N, T, H, K]``; v: ``[N, T, HV, V]``; a, b: ``[N, T, HV]``;
        A_log, dt_bias: ``[HV]``; initial_state: ``[N, HV, V, K]``.

    Returns:
        ``(o [N, T, HV, V], states [N, T, HV, V, K])`` in ``dtype``: the output and the state
        after each token.
    """
    N, T = q.shape[:2]
    g, beta = gdn_gate_ref(a, b, A_log, dt_bias, dtype)
    cu = torch.arange(0, N * T + 1, T)
    o, _, states = recurrent_gated_delta_rule_ref(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), g.flatten(0, 1), beta.flatten(0, 1),
        scale=scale, initial_state=initial_state, cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm,
        checkpoint_every=1, dtype=dtype,
    )
    return o.view(N, T, *o.shape[1:]), states.view(N, T, *states.shape[1:])


# ----------------------------------------------------------------------------- AutoCP
# AutoCP reference. AutoCP: gate-driven intra-card context parallelism for chunked prefill — planner and reference.
#
# Why: the chunk-to-chunk state pass is serial along a sequence. With TP-sharded heads
# (Qwen3.5-397B at TP8 keeps 8 value heads per GPU) a long prompt gives the state kernel
# ``HV x V-blocks`` independent chains, 16 for 8 heads, on a 132-SM GPU. Cutting each long
# sequence into ``P`` segments that run side by side multiplies that by ``P``, provided each
# segment can get its start state without waiting for the segment before it.
#
# How a segment's start state is rebuilt (per segment and value head, decided on the device
# from the actual gates):
#
# (a) **Warm-up.** Run the recurrence from a zero state over the ``W`` tokens before the
#     segment. The state at the segment start ``s`` is ``S(s) = S(s - W) M + X`` where ``X`` is
#     the warm-up result and ``M`` the product of the window's transitions
#     ``exp(g_t) (I - beta_t k_t k_t^T)``. With L2-normalised keys and ``beta`` in [0, 1] every
#     factor ``I - beta k k^T`` has spectral norm <= 1, so ``||M||_2 <= exp(sum_window g)``
#     and the warm-up error is at most ``exp(sum_window g) * ||S(s - W)||``.
# (b) **Exact.** For heads whose gate does not decay enough over the window the start state
#     must be the true one. The reference below carries it through the segment transitions:
#     each segment ``p`` computed from zero gives ``X_p`` and from the identity (with ``u = 0``)
#     its transition ``A_p``, then ``h_{p+1} = A_p h_p + X_p`` (a short scan over segments). The
#     kernel (``qla_serving.kernels.chunk_prefill``) takes the simpler exact route: the block of
#     such a (segment, head) replays the sequence from its start with the true initial state,
#     which costs that head the speedup but no accuracy; with Qwen-like gates few heads need it.
#
# The error argument for (a), with numbers. bf16 keeps 8 significant bits, so each stored
# element carries a relative rounding error up to ``2^-9 ~ 2.0e-3``; the kernels' measured
# output error against the float64 oracle is of that order (a few 1e-3, see the GPU tests).
# Warm-up is used only where ``exp(sum_window g) <= 2^-16 ~ 1.5e-5`` (``sum_window g <=
# -11.09``). The truncated term is then at most ``1.5e-5 * ||S(s - W)||``. Under a decaying
# gate the state norm is near-stationary; even allowing ``||S(s - W)|| <= 16 ||S(s)||`` the
# relative error added is ``<= 2.4e-4``, about a tenth of one bf16 rounding step, so the CP
# path's total error stays within ``1.1x`` of the non-CP path's. Heads that decay less
# (``A_log`` near -4 makes ``g ~ -0.01`` per token, ~ -3 over 256 tokens) take (b).


def chunk_gated_delta_rule_cp_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cp: ContextParallelPlan,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    log_decay_threshold: float = LOG_DECAY_THRESHOLD,
    mode: str = "auto",
    dtype: torch.dtype = torch.float32,
):
    """The chunked gated delta rule computed segment-parallel, as the AutoCP kernels do.

    Arguments are those of :func:`~.naive.chunk_gated_delta_rule_ref` plus ``cp`` (the
    segments) and ``mode``: ``"auto"`` picks warm-up or exact per (segment, head) from the
    gates, ``"warmup"``/``"exact"`` force one (for tests).

    Returns:
        ``(o [T, HV, V], final_state [N, HV, V, K], warmup_used)`` where ``warmup_used`` lists,
        per sequence, a ``[P, HV]`` bool tensor (segment 0 is never warm-started).
    """
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    scale = K**-0.5 if scale is None else scale
    dev = q.device
    q, k, v, g, beta = prepare_inputs(q, k, v, g, beta, use_qk_l2norm, dtype)
    o = torch.zeros(T, HV, V, dtype=dtype, device=dev)
    finals, modes = [], []
    for n, (bos, eos) in enumerate(_seq_bounds(cu_seqlens, T)):
        h0 = (torch.zeros(HV, K, V, dtype=dtype, device=dev) if initial_state is None
              else initial_state[n].to(dtype).transpose(-1, -2))
        starts = [s for s in cp.segments[n] if s < eos - bos] or [0]
        bounds = list(zip(starts, starts[1:] + [eos - bos]))
        qs, ks, vs, gs, bs = (x[bos:eos] for x in (q, k, v, g, beta))
        # (b) exact: each segment from zero (X) and its transition from the identity with no
        # values (A), both independent of the segments before; then the scan h' = A h + X.
        eye = torch.eye(K, dtype=dtype, device=dev).expand(HV, K, K).clone()
        exact = [h0]
        for s, e in bounds[:-1]:
            _, X = chunk_state_pass(ks[s:e], vs[s:e], gs[s:e], bs[s:e], torch.zeros_like(h0))
            _, A = chunk_state_pass(ks[s:e], torch.zeros_like(ks[s:e]), gs[s:e], bs[s:e], eye)
            exact.append(A @ exact[-1] + X)
        used = torch.zeros(len(bounds), HV, dtype=torch.bool, device=dev)
        for p, (s, e) in enumerate(bounds):
            start = exact[p]
            w0 = max(s - cp.warmup_tokens, 0)
            # (a) warm-up. A window that reaches the sequence start begins at the initial state
            # and is exact, so it is not counted as a warm-up.
            if p > 0 and w0 > 0 and mode != "exact":
                _, warm = chunk_state_pass(ks[w0:s], vs[w0:s], gs[w0:s], bs[w0:s], torch.zeros_like(h0))
                take = (torch.ones(HV, dtype=torch.bool, device=dev) if mode == "warmup"
                        else gs[w0:s].sum(0) <= log_decay_threshold)
                used[p] = take
                start = torch.where(take[:, None, None], warm, start)
            per_chunk, h_end = chunk_state_pass(ks[s:e], vs[s:e], gs[s:e], bs[s:e], start)
            o[bos + s:bos + e] = chunk_output(qs[s:e], ks[s:e], per_chunk, scale)
        finals.append(h_end.transpose(-1, -2))
        modes.append(used)
    return o, torch.stack(finals), modes


# The prefill benchmark's grid (issue #3): value heads per GPU and batch compositions.
