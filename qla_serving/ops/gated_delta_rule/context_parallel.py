"""AutoCP: gate-driven intra-card context parallelism for chunked prefill — planner and reference.

Why: the chunk-to-chunk state pass is serial along a sequence. With TP-sharded heads
(Qwen3.5-397B at TP8 keeps 8 value heads per GPU) a long prompt gives the state kernel
``HV x V-blocks`` independent chains, 16 for 8 heads, on a 132-SM GPU. Cutting each long
sequence into ``P`` segments that run side by side multiplies that by ``P``, provided each
segment can get its start state without waiting for the segment before it.

How a segment's start state is rebuilt (per segment and value head, decided on the device
from the actual gates):

(a) **Warm-up.** Run the recurrence from a zero state over the ``W`` tokens before the
    segment. The state at the segment start ``s`` is ``S(s) = S(s - W) M + X`` where ``X`` is
    the warm-up result and ``M`` the product of the window's transitions
    ``exp(g_t) (I - beta_t k_t k_t^T)``. With L2-normalised keys and ``beta`` in [0, 1] every
    factor ``I - beta k k^T`` has spectral norm <= 1, so ``||M||_2 <= exp(sum_window g)``
    and the warm-up error is at most ``exp(sum_window g) * ||S(s - W)||``.
(b) **Exact.** For heads whose gate does not decay enough over the window the start state
    must be the true one. The reference below carries it through the segment transitions:
    each segment ``p`` computed from zero gives ``X_p`` and from the identity (with ``u = 0``)
    its transition ``A_p``, then ``h_{p+1} = A_p h_p + X_p`` (a short scan over segments). The
    kernel (``qla_serving.kernels.chunk_prefill``) takes the simpler exact route: the block of
    such a (segment, head) replays the sequence from its start with the true initial state,
    which costs that head the speedup but no accuracy; with Qwen-like gates few heads need it.

The error argument for (a), with numbers. bf16 keeps 8 significant bits, so each stored
element carries a relative rounding error up to ``2^-9 ~ 2.0e-3``; the kernels' measured
output error against the float64 oracle is of that order (a few 1e-3, see the GPU tests).
Warm-up is used only where ``exp(sum_window g) <= 2^-16 ~ 1.5e-5`` (``sum_window g <=
-11.09``). The truncated term is then at most ``1.5e-5 * ||S(s - W)||``. Under a decaying
gate the state norm is near-stationary; even allowing ``||S(s - W)|| <= 16 ||S(s)||`` the
relative error added is ``<= 2.4e-4``, about a tenth of one bf16 rounding step, so the CP
path's total error stays within ``1.1x`` of the non-CP path's. Heads that decay less
(``A_log`` near -4 makes ``g ~ -0.01`` per token, ~ -3 over 256 tokens) take (b).

Planning (host, once per batch, shared by every layer): CP only pays when the serial pass
is bounded by its longest chain rather than by its total work; :func:`plan_context_parallel`
estimates both with and without segments (a cost model in chunk steps, one block per SM)
and splits only where that wins by a margin. Segments never drop below
``min_segment_tokens`` (so the warm-up costs at most ``W / min_segment`` extra work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .naive import CHUNK_SIZE, _seq_bounds, chunk_output, chunk_state_pass, prepare_inputs

# Warm-up is trusted where the window's decay is below 2^-16 (see the module docstring).
LOG_DECAY_THRESHOLD = -16 * math.log(2)


@dataclass(frozen=True)
class ContextParallelPlan:
    """How the planner cuts the batch.

    Attributes:
        segment_tokens: tokens per segment (a multiple of 64); a sequence's last segment
            may be shorter.
        warmup_tokens: tokens of warm-up before each segment after the first (multiple of 64).
        segments: per sequence, the segment start offsets within the sequence (first is 0).
    """

    segment_tokens: int
    warmup_tokens: int
    segments: tuple[tuple[int, ...], ...]

    @property
    def num_segments(self) -> int:
        return sum(len(s) for s in self.segments)


def _makespan(chunk_counts: list[int], num_v_heads: int, sm_count: int, seg: int | None, warm: int,
              min_cp_chunks: int, unsplit: tuple[int, int, int] = (0, 0, 0)) -> float:
    """Estimated time of the serial pass, in chunk steps.

    One block per (work item, value head) and one block per SM (the fused kernel's shared
    memory), every chunk step about the same time (measured on H100: ~8.3 us per chunk and
    block), warm-up steps counted like the others. All blocks in one wave: the longest item.
    More blocks than SMs: the smaller of two estimates. Blocks of nearly equal length run in
    waves of one block per SM, ``ceil(blocks / SMs)`` times the longest item (a last wave of a
    few blocks costs a whole item); blocks of very different lengths (a long split sequence
    among short ones) are list-scheduled, the total work over the SMs plus half an item for
    the last wave's raggedness. The wave term was added after forced segment lengths on an
    H200 (docs/autocp.md): the older estimate alone picked 2752 tokens at 16/64 heads
    24576+8192, 1.037x slower than the 8192 that waves pick; every grid cell whose decision
    the wave term changed measured 1.01-1.09x faster with it.

    ``unsplit`` is ``(longest, total, count)`` of sequences never split (shorter than
    ``min_cp_chunks``), summarised once by the caller instead of walked per candidate.
    """
    longest, total, blocks = unsplit[0], unsplit[1], unsplit[2] * num_v_heads
    for n in chunk_counts:
        if seg is None or n <= seg or n < min_cp_chunks:
            items = [n]
        else:
            pieces = -(-n // seg)
            items = [seg] + [seg + warm] * (pieces - 2) + [n - seg * (pieces - 1) + warm]
        longest = max(longest, *items)
        total += sum(items)
        blocks += len(items) * num_v_heads
    if blocks <= sm_count:
        return float(longest)
    waves = -(-blocks // sm_count)
    return min(float(waves * longest), max(longest, total * num_v_heads / sm_count) + longest / 2)


# Blocks per (work item, value head) of chunk_fwd: one, the whole V = 128 in one block
# (kernels/chunk_prefill.py).
KERNEL_V_BLOCKS = 1


def plan_context_parallel(
    seq_lens: list[int],
    num_v_heads: int,
    sm_count: int,
    *,
    v_blocks_per_head: int | None = None,
    min_cp_tokens: int = 2048,
    min_segment_tokens: int = 512,
    warmup_tokens: int = 256,
    min_gain: float = 1.1,
    segment_tokens: int | None = None,
) -> ContextParallelPlan | None:
    """Decide whether and how to split long sequences; None means no CP.

    The serial pass runs one block per (work item, value head, V block); without CP a work
    item is a sequence. Its time is bounded below by the longest item and by the total work
    over the SMs (:func:`_makespan`). Splitting sequences of at least ``min_cp_tokens`` into
    equal segments (multiples of 64 tokens, at least ``min_segment_tokens``) shortens the
    longest item at the price of ``warmup_tokens`` extra per segment; the planner tries every
    segment length from the longest sequence's halves down to the minimum and keeps the
    fastest estimate, but only if it beats no CP by ``min_gain`` (so CP is never chosen where
    the total work, not the chain length, bounds the time).

    Args:
        seq_lens: token count of each sequence.
        num_v_heads: value heads on this GPU (after TP sharding).
        sm_count: multiprocessors of the GPU.
        v_blocks_per_head: blocks per (item, head); default: the kernel's (``KERNEL_V_BLOCKS``).
        min_cp_tokens: only sequences at least this long are split.
        min_segment_tokens: shortest segment (bounds the warm-up overhead to W / segment).
        warmup_tokens: warm-up window ``W``.
        min_gain: plan CP only when its estimate is this much faster than without.
        segment_tokens: an override for experiments (uniform segments of this length).
    """
    if warmup_tokens % CHUNK_SIZE or (segment_tokens is not None and segment_tokens % CHUNK_SIZE):
        raise ValueError(f"segment_tokens={segment_tokens} and warmup_tokens={warmup_tokens} must be multiples "
                         f"of {CHUNK_SIZE}")
    if segment_tokens is not None:
        segs = tuple(tuple(range(0, L, segment_tokens)) if L > segment_tokens else (0,) for L in seq_lens)
    else:
        chunks = [-(-L // CHUNK_SIZE) for L in seq_lens]
        if not chunks or max(chunks) * CHUNK_SIZE < min_cp_tokens:
            return None
        blocks = num_v_heads * (KERNEL_V_BLOCKS if v_blocks_per_head is None else v_blocks_per_head)
        warm, min_cp, min_seg = warmup_tokens // CHUNK_SIZE, min_cp_tokens // CHUNK_SIZE, min_segment_tokens // CHUNK_SIZE
        # Only sequences of at least min_cp chunks can be split; the rest weigh the same in
        # every candidate (a batch may hold hundreds of them: summarised once, not per candidate).
        short = [n for n in chunks if n < min_cp]
        unsplit = (max(short, default=0), sum(short), len(short))
        splittable = [n for n in chunks if n >= min_cp]
        best_seg, best = None, _makespan(splittable, blocks, sm_count, None, warm, min_cp, unsplit)
        no_cp = best
        for parts in range(2, max(chunks) // min_seg + 1):
            seg = -(-max(chunks) // parts)
            t = _makespan(splittable, blocks, sm_count, seg, warm, min_cp, unsplit)
            if t < best:
                best_seg, best = seg, t
        if best_seg is None or best * min_gain > no_cp:
            return None
        seg_tokens = best_seg * CHUNK_SIZE
        segs = tuple(tuple(range(0, L, seg_tokens)) if L >= min_cp_tokens and L > seg_tokens else (0,)
                     for L in seq_lens)
    if all(len(s) == 1 for s in segs):
        return None
    longest = max((b - a) for s, L in zip(segs, seq_lens) for a, b in zip(s, s[1:] + (L,)))
    return ContextParallelPlan(segment_tokens or longest, warmup_tokens, segs)


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
GRID_HEADS = (8, 16, 24, 32, 48, 64)
GRID_BATCHES = {
    "1x32768": [32768], "1x8192": [8192], "1x2048": [2048],
    "24576+8192": [24576, 8192], "8x4096": [4096] * 8, "8x1024": [1024] * 8,
}


def decision_table(sm_count: int = 132, v_blocks_per_head: int | None = None) -> str:
    """The planner's decisions over the benchmark grid as a markdown table (docs/autocp.md)."""
    lines = ["| value heads | " + " | ".join(GRID_BATCHES) + " |", "|---|" + "---|" * len(GRID_BATCHES)]
    for hv in GRID_HEADS:
        cells = []
        for lens in GRID_BATCHES.values():
            cp = plan_context_parallel(lens, hv, sm_count, v_blocks_per_head=v_blocks_per_head)
            cells.append("–" if cp is None else
                         f"{cp.segment_tokens} x {max(len(s) for s in cp.segments)}, warm-up {cp.warmup_tokens}")
        lines.append(f"| {hv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
