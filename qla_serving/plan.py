"""Host-side prefill planning: built once per batch from CPU lengths, read by every layer.

Like vLLM's attention metadata, a :class:`PrefillPlan` holds every decision and index table
that depends only on the batch composition (sequence lengths, chunk layout, checkpoint
slots), so a kernel call neither syncs with the host nor decides anything itself.

AutoCP (context parallelism inside one GPU, ``docs/autocp.md``) is planned here too.
Planning (host, once per batch, shared by every layer): CP only pays when the serial pass
is bounded by its longest chain rather than by its total work; :func:`plan_context_parallel`
estimates both with and without segments (a cost model in chunk steps, one block per SM)
and splits only where that wins by a margin. Segments never drop below
``min_segment_tokens`` (so the warm-up costs at most ``W / min_segment`` extra work).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from .constants import CHUNK_SIZE


@dataclass
class PrefillPlan:
    """Chunk layout of one varlen batch.

    Attributes:
        cu_seqlens_cpu: ``[N + 1]`` int64, CPU — sequence offsets into the token dim.
        cu_seqlens: ``[N + 1]`` int32 on ``device`` — the same offsets for kernels.
        chunk_offsets_cpu / chunk_offsets: ``[N + 1]`` int32 — cumulative 64-token chunk
            counts; sequence ``i`` owns chunks ``chunk_offsets[i] : chunk_offsets[i + 1]``.
        chunk_indices: ``[num_chunks, 2]`` int32 on ``device`` — ``(sequence, chunk within
            sequence)`` of every chunk, in order.
        chunk_bounds: ``[num_chunks, 2]`` int32 on ``device`` — ``(first token, end of its
            sequence)`` of every chunk: a kernel block finds its tokens with one table read
            instead of two dependent ones (``chunk_indices``, then ``cu_seqlens``).
        checkpoint_every: tokens between checkpoints (a multiple of 64) or None.
        checkpoint_offsets_cpu / checkpoint_offsets: ``[N + 1]`` int32 — sequence ``i``
            writes its checkpoints to rows ``checkpoint_offsets[i] : checkpoint_offsets[i + 1]``.
        work_items_cpu / work_items: ``[W, 4]`` int32 — the units of the serial pass, one
            block column each: ``(sequence, first chunk, first output chunk, end chunk)``,
            chunks counted within the sequence. Without context parallelism one item per
            sequence ``(i, 0, 0, num_chunks_i)``; with it, a long sequence becomes several items
            that start ``warmup`` chunks before their first output chunk.
        context_parallel: the AutoCP decision (None: not used for this batch).
        extras: room for kernel-specific tables derived from the same inputs.
    """

    cu_seqlens_cpu: torch.Tensor
    cu_seqlens: torch.Tensor
    chunk_offsets_cpu: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_bounds: torch.Tensor
    checkpoint_every: int | None
    checkpoint_offsets_cpu: torch.Tensor
    checkpoint_offsets: torch.Tensor
    work_items_cpu: torch.Tensor
    work_items: torch.Tensor
    context_parallel: ContextParallelPlan | None = None
    chunk_size: int = CHUNK_SIZE
    extras: dict = field(default_factory=dict)

    # The sizes below are read by every layer's op and kernel call: computed once per plan (the
    # tables are not changed after planning), not once per layer.
    @functools.cached_property
    def num_seqs(self) -> int:
        return self.cu_seqlens_cpu.numel() - 1

    @functools.cached_property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens_cpu[-1])

    @functools.cached_property
    def num_chunks(self) -> int:
        return int(self.chunk_offsets_cpu[-1])

    @functools.cached_property
    def num_checkpoints(self) -> int:
        return int(self.checkpoint_offsets_cpu[-1])

    @property
    def seq_lens(self) -> list[int]:
        return list(self._seq_lens)

    @functools.cached_property
    def _seq_lens(self) -> tuple[int, ...]:
        return tuple(self.cu_seqlens_cpu.diff().tolist())

    @functools.cached_property
    def max_seqlen(self) -> int:
        return max(self._seq_lens, default=0)

    @functools.cached_property
    def seq_ids(self) -> torch.Tensor:
        """``[N]`` int32 on the device, ``0 .. N - 1``: the start-state rows of a context-parallel
        batch, whose kernel reads start states from a snapshot of the sequences' slots
        (:func:`plan_prefill` copies it with the other tables when it plans context parallelism)."""
        return torch.arange(self.num_seqs, dtype=torch.int32, device=self.cu_seqlens.device)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device


def plan_prefill(
    cu_seqlens_cpu: torch.Tensor | list[int],
    *,
    device: torch.device | str | None = None,
    checkpoint_every: int | None = None,
    chunk_size: int = CHUNK_SIZE,
    num_v_heads: int | None = None,
    sm_count: int | None = None,
    cp_segment_tokens: int | None = None,
    cp_per_sequence: bool | None = None,
) -> PrefillPlan:
    """Build the plan of one prefill batch on the host.

    Args:
        cu_seqlens_cpu: ``[N + 1]`` non-decreasing integer offsets starting at 0, on the CPU
            (a list is accepted). Zero-length sequences are allowed and own no chunk.
        device: where the kernels run; the index tables are copied there once (for a CUDA
            device: all of them in one non-blocking copy from pinned memory).
        checkpoint_every: write the state every this many tokens (a positive multiple of
            ``chunk_size``) for prefix caching; None for no checkpoints.
        chunk_size: tokens per chunk (64: the kernels' chunk).
        num_v_heads: value heads per layer on this GPU. Given it, the planner decides AutoCP
            (intra-card context parallelism) for the batch; None plans without it.
        sm_count: multiprocessors of the GPU (default: queried from ``device`` once).
        cp_segment_tokens: experiments only — force segments of this many tokens (0 turns
            AutoCP off); the environment variable ``QLA_CP_SEGMENT_TOKENS`` does the same.
            ``QLA_BATCH_INVARIANT=1`` turns AutoCP off unless one of them is given;
            ``QLA_CP_PER_SEQUENCE=1`` plans each sequence as if it were alone
            (:func:`plan_each_sequence_alone`).
        cp_per_sequence: plan AutoCP per sequence (:func:`plan_each_sequence_alone`: the same
            bits for a sequence in any batch) when True, with the batch when False; None reads
            ``QLA_CP_PER_SEQUENCE``. An engine's deterministic mode passes True. AutoCP off
            (``cp_segment_tokens=0`` or ``QLA_BATCH_INVARIANT=1``) wins over it.

    Returns:
        A :class:`PrefillPlan`.
    """
    cu = torch.as_tensor(cu_seqlens_cpu)
    if cu.device.type != "cpu":
        raise ValueError(
            f"plan_prefill needs cu_seqlens on the CPU (got {cu.device}): planning on the host "
            "avoids a device->host sync in every layer"
        )
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
    if cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu.dtype}")
    cu = cu.to(torch.int64)
    cu_list = cu.tolist()  # the checks and the per-sequence planning on host lists, the tables in numpy
    if cu_list[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {cu_list[0]}")
    lens_list = [b - a for a, b in zip(cu_list, cu_list[1:])]
    if any(L < 0 for L in lens_list):
        raise ValueError("cu_seqlens must be non-decreasing")
    if cu_list[-1] >= 2**31:
        raise ValueError(f"total token count {cu_list[-1]} exceeds the int32 index range")
    if checkpoint_every is not None and (checkpoint_every <= 0 or checkpoint_every % chunk_size):
        raise ValueError(f"checkpoint_every={checkpoint_every} must be a positive multiple of {chunk_size}")

    # The tables in numpy (a few microseconds each; a torch op on small CPU tensors costs several),
    # handed to torch as views of the same memory.
    cu_np = np.asarray(cu_list, dtype=np.int64)
    lens_np = np.diff(cu_np)
    chunks_np = -(-lens_np // chunk_size)
    chunk_offsets_np = np.zeros(len(lens_list) + 1, dtype=np.int64)
    np.cumsum(chunks_np, out=chunk_offsets_np[1:])
    ckpt_offsets_np = np.zeros(len(lens_list) + 1, dtype=np.int64)
    if checkpoint_every:
        np.cumsum(lens_np // checkpoint_every, out=ckpt_offsets_np[1:])
    seq_of_chunk = np.repeat(np.arange(len(lens_list), dtype=np.int64), chunks_np)
    chunk_in_seq = np.arange(seq_of_chunk.shape[0], dtype=np.int64) - chunk_offsets_np[seq_of_chunk]
    chunk_indices = torch.from_numpy(np.stack([seq_of_chunk, chunk_in_seq], axis=1).astype(np.int32))
    chunk_bounds = torch.from_numpy(
        np.stack([cu_np[seq_of_chunk] + chunk_in_seq * chunk_size, cu_np[seq_of_chunk + 1]], axis=1).astype(np.int32))
    chunk_offsets = torch.from_numpy(chunk_offsets_np.astype(np.int32))
    ckpt_offsets = torch.from_numpy(ckpt_offsets_np.astype(np.int32))
    chunks_list = chunks_np.tolist()
    num_chunks, num_checkpoints = int(chunk_offsets_np[-1]), int(ckpt_offsets_np[-1])

    device = torch.device(device) if device is not None else torch.device("cpu")

    cp = None
    if cp_segment_tokens is None and os.environ.get("QLA_CP_SEGMENT_TOKENS"):
        cp_segment_tokens = int(os.environ["QLA_CP_SEGMENT_TOKENS"])
    if cp_segment_tokens is None and env_flag("QLA_BATCH_INVARIANT"):
        cp_segment_tokens = 0  # AutoCP's split follows the batch (qla_serving.backend.batch_invariant)
    if num_v_heads is not None and cp_segment_tokens != 0:
        if sm_count is None:
            sm_count = _sm_count(device)
        if cp_per_sequence is None:
            cp_per_sequence = env_flag("QLA_CP_PER_SEQUENCE")
        if sm_count and cp_segment_tokens is None and cp_per_sequence:
            cp = plan_each_sequence_alone(lens_list, num_v_heads, sm_count)
        elif sm_count:
            cp = plan_context_parallel(lens_list, num_v_heads, sm_count, segment_tokens=cp_segment_tokens)
    work_items = _work_items(chunks_list, cp, chunk_size)

    host = [torch.from_numpy(cu_np.astype(np.int32)), chunk_offsets, chunk_indices, chunk_bounds, ckpt_offsets,
            work_items]
    if cp is not None:
        host.append(torch.from_numpy(np.arange(len(lens_list), dtype=np.int32)))  # seq_ids
    tables = _to_device(host, device)
    plan = PrefillPlan(
        cu_seqlens_cpu=cu,
        cu_seqlens=tables[0],
        chunk_offsets_cpu=chunk_offsets,
        chunk_offsets=tables[1],
        chunk_indices=tables[2],
        chunk_bounds=tables[3],
        checkpoint_every=checkpoint_every,
        checkpoint_offsets_cpu=ckpt_offsets,
        checkpoint_offsets=tables[4],
        work_items_cpu=work_items,
        work_items=tables[5],
        context_parallel=cp,
        chunk_size=chunk_size,
    )
    # what the host already knows (the cached properties would read it back from the tensors)
    plan.num_seqs = len(lens_list)
    plan.total_tokens = cu_list[-1]
    plan.num_chunks = num_chunks
    plan.num_checkpoints = num_checkpoints
    plan._seq_lens = tuple(lens_list)
    if cp is not None:
        plan.seq_ids = tables[6]
    return plan


# Offsets of the tables inside the one buffer they are copied to the device in: multiples of 512
# bytes, the CUDA caching allocator's own alignment, so each table starts as aligned as a tensor of
# its own would.
_TABLE_ALIGN = 128  # int32 elements


def _to_device(tables: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The plan's int32 index tables on ``device``.

    For a CUDA device they go in one host->device copy (one pinned staging buffer, one
    non-blocking copy; each table a view of the device buffer at an offset aligned like an
    allocation of its own) instead of one pinned allocation and one copy per table: this runs once
    per step, before every layer.
    """
    if device.type == "cpu":
        return tables
    if device.type != "cuda":
        return [t.to(device) for t in tables]
    staging, offsets = _pack(tables, pin=True)
    return _unpack(staging.to(device, non_blocking=True), tables, offsets)


def _pack(tables: list[torch.Tensor], pin: bool) -> tuple[torch.Tensor, list[int]]:
    """One int32 host buffer holding ``tables`` at offsets that are multiples of ``_TABLE_ALIGN``."""
    offsets, total = [], 0
    for t in tables:
        if t.dtype != torch.int32:
            raise TypeError(f"plan tables are int32, got {t.dtype}")
        offsets.append(total)
        total += -(-t.numel() // _TABLE_ALIGN) * _TABLE_ALIGN
    staging = torch.empty(total, dtype=torch.int32, pin_memory=pin)
    for t, o in zip(tables, offsets):
        staging[o: o + t.numel()].copy_(t.reshape(-1))
    return staging, offsets


def _unpack(buffer: torch.Tensor, tables: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    return [buffer[o: o + t.numel()].view(t.shape) for t, o in zip(tables, offsets)]


def _work_items(chunks: list[int], cp: ContextParallelPlan | None, chunk_size: int) -> torch.Tensor:
    """``[W, 4]`` int32 rows ``(sequence, first chunk, first output chunk, end chunk)``: one per
    sequence, or with ``cp`` one per segment, in sequence order."""
    if cp is None:
        rows = np.zeros((len(chunks), 4), dtype=np.int32)
        rows[:, 0], rows[:, 3] = np.arange(len(chunks)), chunks
        return torch.from_numpy(rows)
    warm = cp.warmup_tokens // chunk_size
    items = []
    for i, (segments, n) in enumerate(zip(cp.segments, chunks)):
        if len(segments) == 1:  # most sequences of a batch: whole (a decode row, a short prompt)
            items.append((i, 0, 0, n))
            continue
        starts = [s // chunk_size for s in segments]
        items += [(i, max(s - warm, 0), s, e) for s, e in zip(starts, starts[1:] + [n])]
    return torch.from_numpy(np.array(items, dtype=np.int32))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (0 elsewhere: no AutoCP off the GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------- AutoCP


@dataclass(frozen=True)
class ContextParallelPlan:
    """How the planner cuts the batch.

    Attributes:
        segment_tokens: tokens per segment (a multiple of 64); a sequence's last segment
            may be shorter.
        warmup_tokens: tokens of warm-up before each segment after the first (multiple of 64).
        segments: per sequence, the segment start offsets within the sequence: the first 0, every
            one before the sequence's end (a sequence of no tokens: ``(0,)``).
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
# (kernels/chunk_prefill_program.py).
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
        segs, longest = _cut(seq_lens, segment_tokens, segment_tokens + 1)
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
        most = max(chunks)
        for parts in range(2, most // min_seg + 1):
            seg = -(-most // parts)
            t = _makespan(splittable, blocks, sm_count, seg, warm, min_cp, unsplit)
            if t < best:
                best_seg, best = seg, t
        if best_seg is None or best * min_gain > no_cp:
            return None
        seg_tokens = best_seg * CHUNK_SIZE
        segs, longest = _cut(seq_lens, seg_tokens, max(min_cp_tokens, seg_tokens + 1))
    if longest is None:
        return None
    return ContextParallelPlan(segment_tokens or longest, warmup_tokens, segs)


def _cut(seq_lens: list[int], seg_tokens: int, min_tokens: int) -> tuple[tuple[tuple[int, ...], ...], int | None]:
    """Segment starts per sequence: every ``seg_tokens`` for a sequence of at least ``min_tokens``
    (> ``seg_tokens``), else ``(0,)``; and the longest segment (None when no sequence is cut). The
    starts of one length are built once: a batch repeats lengths."""
    cuts: dict[int, tuple[int, ...]] = {}
    whole = (0,)
    segs = tuple(whole if L < min_tokens else cuts.get(L) or cuts.setdefault(L, tuple(range(0, L, seg_tokens)))
                 for L in seq_lens)
    if not cuts:
        return segs, None
    # a cut sequence's first segment is the longest of its own; a whole one is all one segment
    return segs, max(seg_tokens, max((L for L in seq_lens if L < min_tokens), default=0))


def plan_each_sequence_alone(seq_lens: list[int], num_v_heads: int, sm_count: int) -> ContextParallelPlan | None:
    """AutoCP's split of each sequence as :func:`plan_context_parallel` makes it for that sequence
    alone, whatever else the batch holds; None when no sequence is split.

    A segment's work depends only on its own bounds and warm-up, so a sequence planned this way
    gets the same bits alone and in any batch; the price is segments (and their warm-ups) in batches
    that fill the GPU without them, where the batch planner would not split: 17-35% of the prefill in
    batches of several 2048-8192-token sequences on an H200 (``QLA_CP_PER_SEQUENCE=1``, SGLang's
    deterministic inference; docs/autocp.md).

    Args:
        seq_lens: token count of each sequence.
        num_v_heads: value heads on this GPU (after TP sharding).
        sm_count: multiprocessors of the GPU.
    """
    alone = {L: _plan_alone(L, num_v_heads, sm_count) for L in set(seq_lens)}
    split = [cp for cp in alone.values() if cp is not None]
    if not split:
        return None
    segs = tuple(alone[L].segments[0] if alone[L] is not None else (0,) for L in seq_lens)
    # a sequence's plan alone names its longest segment; a sequence not cut is one
    longest = max(cp.segment_tokens if cp is not None else L for L, cp in alone.items())
    return ContextParallelPlan(longest, split[0].warmup_tokens, segs)


@functools.lru_cache(maxsize=4096)
def _plan_alone(seq_len: int, num_v_heads: int, sm_count: int) -> ContextParallelPlan | None:
    """:func:`plan_context_parallel` of one sequence alone (a pure function of its arguments, so
    kept: a server meets the same lengths step after step)."""
    return plan_context_parallel([seq_len], num_v_heads, sm_count)


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1 (true, yes, on)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


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
