"""Per-step GDN metadata with qla-serving's prefill plan attached.

vLLM builds one ``GDNAttentionMetadata`` per step (per KV-cache group) in
``GDNAttentionMetadataBuilder.build``, from host-side query lengths; every GDN layer of the
group reads it. The subclass here runs vLLM's build unchanged and, for a step with prefills
while ``flashqla`` is requested, adds a :class:`qla_serving.plan.PrefillPlan` built on the
host from the same CPU lengths vLLM used, so no layer plans or syncs again.

Our layer (:mod:`.layer`) returns :class:`QlaGDNAttentionBackend` from ``get_attn_backend``,
which is how vLLM picks this builder: a registration seam, no patch.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends import gdn_attn
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)

from qla_serving import backend
from qla_serving.plan import PrefillPlan, plan_prefill

from .args import flashqla_requested

logger = logging.getLogger("vllm.qla_serving")


@dataclass
class QlaGDNAttentionMetadata(GDNAttentionMetadata):
    """vLLM's GDN metadata plus what qla-serving's prefill needs.

    Attributes (all None when the step has no prefill or flashqla is not requested):
        qla_plan: the plan of the prefill sequences (vLLM's ``prefill_query_start_loc``
            order, zero-length rows dropped).
        qla_prefill_state_indices: ``[plan.num_seqs]`` int32 on the device — pool slot of each
            planned sequence (vLLM's ``prefill_state_indices`` without zero-length rows).
        qla_prefill_has_initial_state: ``[plan.num_seqs]`` bool on the device.
        qla_prefill_rows: ``[plan.num_seqs]`` int64 on the device — which of vLLM's prefill
            rows the plan keeps, or None when it keeps them all.
        qla_bound: the step's bound launches (``QLA_BOUND_LAUNCH``), filled by its first GDN
            layer and rerun by the others: layout key -> launch.
        qla_fresh_prefill_tokens: ``[F]`` int64 on the device — unless ``QLA_FRESH_ON_DECODE=0``, the
            token of each new one-token prompt that vLLM's split made a prefill row; the layer
            reruns it on the decode kernel from the zero state after the prefill. None otherwise.
        qla_fresh_prefill_slots: ``[F]`` int32 — their state slots (vLLM's indices).

    Speculative servers only (``num_speculative_tokens > 0``; None otherwise):
        qla_resume_src: ``[R]`` int64 on the device — for each one-token row without drafts this
            step, the slot holding its state: block-table column ``num_accepted - 1``. vLLM
            reads column 0 for such rows; after a step that accepted drafts (``ngram``, which
            may propose none on the next step) the state is elsewhere. Set only after a step with
            drafts; every layer first moves these states to column 0.
        qla_resume_dst: ``[R]`` int64 — column 0 of the same rows.
        qla_resume_conv_cols: ``[R, 1, W - 1]`` int64 — the conv window of each such row, columns
            ``num_accepted - 1 ..`` of its conv state, which move to columns ``0 .. W - 2``.
        qla_spec_gather: ``[rows * T]`` int64 — for drafts of unequal length (``ngram``), the
            speculative token behind each of ``T = num_spec + 1`` positions per row (a short
            row repeats its last token); None when every row has ``T`` tokens.
        qla_spec_write: ``[rows * T]`` int64 — the slot the state after each position goes to
            (its block-table column; vLLM's null block past the row's tokens).
        qla_spec_keep: ``[num_spec_decode_tokens]`` int64 — the positions that are real tokens.
    """

    qla_plan: PrefillPlan | None = None
    qla_prefill_state_indices: torch.Tensor | None = None
    qla_prefill_has_initial_state: torch.Tensor | None = None
    qla_prefill_rows: torch.Tensor | None = None
    qla_bound: dict = dataclasses.field(default_factory=dict)
    qla_fresh_prefill_tokens: torch.Tensor | None = None
    qla_fresh_prefill_slots: torch.Tensor | None = None
    qla_resume_src: torch.Tensor | None = None
    qla_resume_dst: torch.Tensor | None = None
    qla_resume_conv_cols: torch.Tensor | None = None
    qla_spec_gather: torch.Tensor | None = None
    qla_spec_write: torch.Tensor | None = None
    qla_spec_keep: torch.Tensor | None = None


def as_qla_metadata(md: GDNAttentionMetadata) -> QlaGDNAttentionMetadata:
    """vLLM's step metadata ``md`` as ours, sharing its fields (ours at their defaults), without
    the dataclass ``__init__`` of its ~30 fields: the build runs once per GDN group and step on the
    host's critical path, all that is ours in a FULL-graph decode step."""
    out = object.__new__(QlaGDNAttentionMetadata)
    out.__dict__.update(vars(md))
    out.qla_bound = {}  # (the one field of ours whose default is no class attribute)
    return out


def prefill_query_lens_cpu(
    query_start_loc_cpu: torch.Tensor,
    num_reqs: int,
    num_decodes: int,
    spec_sequence_mask_cpu: torch.Tensor | None,
) -> list[int]:
    """Host lengths of the sequences vLLM sends to the chunked prefill, in its order.

    Mirrors ``GDNAttentionMetadataBuilder.build``: without speculative rows the batch is
    ``[decodes | prefills]`` and decodes are peeled off the front; with speculative rows the
    non-speculative rows (decodes reclassified as prefills) all go to the chunked prefill.
    Worked out on host lists (one read of vLLM's CPU offsets): this runs once per step.

    Args:
        query_start_loc_cpu: ``[num_reqs + 1]`` (or longer, padded) int32 CPU offsets.
        num_reqs: requests in the step.
        num_decodes: vLLM's ``num_decodes`` (0 when speculative rows exist).
        spec_sequence_mask_cpu: ``[num_reqs]`` bool, True for speculative rows, or None.
    """
    qsl = query_start_loc_cpu[: num_reqs + 1].tolist()
    lens = [b - a for a, b in zip(qsl, qsl[1:])]
    if spec_sequence_mask_cpu is not None:
        spec = spec_sequence_mask_cpu[:num_reqs].tolist()
        return [L for L, s in zip(lens, spec) if not s]
    return lens[num_decodes:]


# vLLM marks a padded row's state slot with NULL_BLOCK_ID (0, a block no request owns): the
# layer hands the decode op its slots as they are, with every slot below 1 a padded row.
VLLM_NULL_BLOCK_ID = 0


_last_plan: tuple[tuple, PrefillPlan] | None = None


def cached_plan(cu_seqlens_cpu: list[int], device: torch.device,
                num_v_heads: int | None = None) -> PrefillPlan:
    """:func:`plan_prefill` of the host offsets ``cu_seqlens_cpu``, reusing the previous plan when
    another KV-cache group of the same step (or a step with identical lengths) asks for the same
    one. With ``num_v_heads`` (the GDN layers' value heads on this GPU) the planner also decides
    AutoCP."""
    global _last_plan
    key = (str(device), tuple(cu_seqlens_cpu), num_v_heads)
    if _last_plan is not None and _last_plan[0] == key:
        return _last_plan[1]
    plan = plan_prefill(cu_seqlens_cpu, device=device, num_v_heads=num_v_heads)
    _last_plan = (key, plan)
    return plan


def _value_heads(kv_cache_spec) -> int | None:
    """Value heads per GPU of the GDN layers: the recurrent state's shape ``(HV, V, K)`` is the
    second of a GDN ``MambaSpec``'s shapes (conv state first). None if this vLLM lays it out
    otherwise: the plan then goes without AutoCP."""
    shapes = getattr(kv_cache_spec, "shapes", None)
    try:
        hv = int(shapes[1][0])
    except (TypeError, IndexError, ValueError):
        return None
    return hv if hv > 0 else None


class QlaGDNAttentionMetadataBuilder(GDNAttentionMetadataBuilder):
    """vLLM's GDN metadata builder that also plans qla-serving's prefill once per step."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.qla_requested = flashqla_requested(vllm_config)
        self.qla_num_v_heads = _value_heads(kv_cache_spec)
        # Speculative servers: the runner's per-request accepted counts (a persistent buffer,
        # handed to the builder only on steps with drafts) and whether the last step had drafts.
        self.qla_accepted: torch.Tensor | None | bool = None  # False: this vLLM passes no view of it
        self.qla_last_step_had_drafts = False
        self._qla_capturing = False
        self._qla_warned_fresh = False
        self.qla_layer_names = list(layer_names)  # whose states a fresh one-token row's slot zeroes
        self.qla_conv_width = int(getattr(vllm_config.model_config.hf_text_config, "linear_conv_kernel_dim", 4))
        self.qla_fresh_on_decode = backend.fresh_rows_on_decode()

    def build(  # type: ignore[override]
        self,
        common_prefix_len: int,
        common_attn_metadata,
        num_accepted_tokens: torch.Tensor | None = None,
        num_decode_draft_tokens_cpu: torch.Tensor | None = None,
        fast_build: bool = False,
    ) -> GDNAttentionMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens,
                           num_decode_draft_tokens_cpu, fast_build)
        if not self.qla_requested:
            return md
        out = as_qla_metadata(md)
        m = common_attn_metadata
        # host: which rows have drafts (None: none has), read once for the helpers below
        spec_mask = (None if md.spec_sequence_masks is None
                     else self._spec_mask_cpu(md, num_decode_draft_tokens_cpu)[: m.num_reqs])
        if md.num_prefills > 0:
            self._attach_plan(out, m, spec_mask)
        if spec_mask is not None:
            lens = m.query_start_loc_cpu[: m.num_reqs + 1].diff()[spec_mask]
            if not bool((lens == self.num_spec + 1).all()):  # (the layer reads the padding's presence)
                self._attach_spec_padding(out, lens.tolist())
        fresh = None if self._qla_capturing else self._fresh_one_token_rows(m, spec_mask)
        if fresh is not None:
            rows, slots = self._zero_fresh_states(md, fresh, spec_mask)
            if self.qla_fresh_on_decode and spec_mask is None and md.num_prefills > 0:
                self._attach_fresh_prefill_rows(out, m, rows, slots)
        if self.num_spec > 0:
            self._attach_resume(out, m, num_accepted_tokens, spec_mask, fresh)
        return out

    def _fresh_one_token_rows(self, m, spec_mask) -> torch.Tensor | None:
        """Rows of requests whose whole prompt is one token, in their first step (host bool
        ``[num_reqs]``), or None when there are none.

        vLLM 0.26's GDN builder splits rows by query length alone, so such a row runs as a decode
        and reads its state slot as the slot's previous request left it (vLLM's Mamba builder
        tells them apart by ``is_prefilling``; its GDN builder does not)."""
        prefilling = getattr(m, "is_prefilling", None)
        seq_lens = getattr(m, "seq_lens_cpu_upper_bound", None)  # exact for prefilling rows
        n = m.num_reqs
        if prefilling is None or seq_lens is None:
            if not self._qla_warned_fresh:
                self._qla_warned_fresh = True
                logger.warning("qla-serving: this vLLM's step metadata has no is_prefilling / "
                               "seq_lens_cpu_upper_bound; a one-token prompt reads its state slot "
                               "as the slot's last request left it, as with vLLM's own GDN kernels")
            return None
        prefilling = prefilling[:n]
        if not any(prefilling.tolist()):  # (a list: half the host time of a tensor's any())
            return None  # (every decode step without new requests ends here)
        lens = m.query_start_loc_cpu[: n + 1].diff()
        fresh = prefilling & (lens == 1) & (seq_lens[:n] == 1)
        if spec_mask is not None:
            fresh &= ~spec_mask
        return fresh if bool(fresh.any()) else None

    def _zero_fresh_states(self, md, fresh: torch.Tensor, spec_mask) -> tuple[list[int], torch.Tensor]:
        """Zero the conv and recurrent state of each fresh one-token row in every layer of this
        group, before the step runs: the decode then starts from the zero state a prefill without
        initial state starts from. Done here, not in the layers, because a step of one-token rows
        replays a FULL CUDA graph captured without it.

        Returns the fresh rows (host, ascending) and their state slots (``[F]``, vLLM's index
        dtype, on the device), which :meth:`_attach_fresh_prefill_rows` reuses."""
        rows = fresh.nonzero().flatten().tolist()
        # the row's place among vLLM's non-speculative rows, whose slots the decode reads
        pos = rows if spec_mask is None else (torch.cumsum((~spec_mask).int(), 0) - 1)[fresh].tolist()
        slots = md.non_spec_state_indices_tensor.index_select(
            0, _to_device(pos, torch.int64, md.non_spec_state_indices_tensor.device))
        long_slots = slots.long()
        context = self.vllm_config.compilation_config.static_forward_context
        for name in self.qla_layer_names:
            for state in getattr(context.get(name), "kv_cache", ()) or ():
                if isinstance(state, torch.Tensor) and state.numel():
                    state.index_fill_(0, long_slots, 0)
        return rows, slots

    def _attach_fresh_prefill_rows(self, md: QlaGDNAttentionMetadata, m, rows: list[int],
                                   slots: torch.Tensor) -> None:
        """The new one-token rows among the prefill rows (unless ``QLA_FRESH_ON_DECODE=0``): their
        tokens and slots, for the layer to rerun on the decode kernel. ``rows`` / ``slots`` are
        every fresh row's, ascending; without drafts rows are tokens' order and decode rows come
        first, so the prefill rows' slots are the tail of ``slots``."""
        first = bisect.bisect_left(rows, md.num_decodes)
        if first == len(rows):
            return
        starts = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
        dev = md.non_spec_state_indices_tensor.device
        md.qla_fresh_prefill_tokens = _to_device([starts[r] for r in rows[first:]], torch.int64, dev)
        md.qla_fresh_prefill_slots = slots[first:]

    def build_for_cudagraph_capture(self, common_attn_metadata):
        # vLLM passes made-up accepted counts here: not the runner's buffer, not a real step
        self._qla_capturing = True
        try:
            return super().build_for_cudagraph_capture(common_attn_metadata)
        finally:
            self._qla_capturing = False

    def _attach_spec_padding(self, md: QlaGDNAttentionMetadata, lens: list[int]) -> None:
        """Drafts of unequal length (``ngram`` proposes up to ``num_spec``): every speculative row
        padded to ``T`` positions, so the verify kernel of uniform rows runs them."""
        T = self.num_spec + 1
        gather, keep, valid, start = [], [], [], 0
        for i, n in enumerate(lens):
            gather += [start + min(t, n - 1) for t in range(T)]
            keep += range(i * T, i * T + n)
            valid += [t < n for t in range(T)]
            start += n
        dev = md.spec_state_indices_tensor.device
        md.qla_spec_gather, md.qla_spec_keep = (_to_device(v, torch.int64, dev) for v in (gather, keep))
        slots = md.spec_state_indices_tensor[: len(lens)].reshape(-1).long()
        md.qla_spec_write = torch.where(_to_device(valid, torch.bool, dev), slots, VLLM_NULL_BLOCK_ID)

    def _attach_resume(self, md: QlaGDNAttentionMetadata, m, num_accepted_tokens, spec_mask, fresh) -> None:
        """Where each one-token row without drafts finds its state, on a speculative server (see
        :class:`QlaGDNAttentionMetadata`)."""
        if self._qla_capturing:
            return
        if num_accepted_tokens is not None and self.qla_accepted is None:
            # the runner's buffer, of which vLLM passes a slice; a tensor that is no view may be a
            # temporary, unreadable on a later step (rows without drafts then read column 0, as
            # vLLM's own kernels do)
            self.qla_accepted = num_accepted_tokens._base
            if self.qla_accepted is None:
                logger.warning("qla-serving: this vLLM hands the GDN builder accepted-token counts that are not "
                               "a view of the runner's buffer; rows without drafts after accepted drafts read "
                               "block-table column 0, as vLLM's own GDN kernels do")
                self.qla_accepted = False
        had_drafts = self.qla_last_step_had_drafts
        self.qla_last_step_had_drafts = md.spec_sequence_masks is not None
        if not had_drafts or not isinstance(self.qla_accepted, torch.Tensor):
            return  # every state is in column 0: the last step accepted at most its one token
        if md.spec_sequence_masks is not None and md.num_prefills == 0 and md.num_decodes == 0:
            return  # every row has drafts
        lens = m.query_start_loc_cpu[: m.num_reqs + 1].diff().tolist()
        spec = [False] * m.num_reqs if spec_mask is None else spec_mask.tolist()
        # one-token rows only: a row that had drafts and has none now runs one token; a longer row
        # without drafts is a prefill chunk, after which the runner counts one accepted token
        # (a fresh one-token prompt has no state to move: its slot was zeroed for this step)
        new = [False] * m.num_reqs if fresh is None else fresh.tolist()
        rows = [i for i, (n, s, f) in enumerate(zip(lens, spec, new)) if n == 1 and not s and not f]
        if not rows:
            return
        dev = m.query_start_loc.device
        table = gdn_attn.mamba_get_block_table_tensor(m.block_table_tensor, m.seq_lens, self.kv_cache_spec,
                                                      self.vllm_config.cache_config.mamba_cache_mode)
        idx = _to_device(rows, torch.int64, dev)
        table = table.index_select(0, idx)[:, : self.num_spec + 1].long()
        col = (self.qla_accepted.index_select(0, idx).long() - 1).clamp_(0, self.num_spec)
        md.qla_resume_src = table.gather(1, col.unsqueeze(1)).squeeze(1)
        md.qla_resume_dst = table[:, 0]
        window = torch.arange(self.qla_conv_width - 1, device=dev)
        md.qla_resume_conv_cols = (col.unsqueeze(1) + window).unsqueeze(1)

    @staticmethod
    def _spec_mask_cpu(md, num_decode_draft_tokens_cpu):
        mask = getattr(md, "spec_sequence_masks_cpu", None)  # vLLM >= 0.31 keeps it
        if mask is None:
            mask = num_decode_draft_tokens_cpu >= 0  # what vLLM derives it from
        return mask

    def _attach_plan(self, md: QlaGDNAttentionMetadata, m, spec_mask) -> None:
        lens = prefill_query_lens_cpu(m.query_start_loc_cpu, m.num_reqs, md.num_decodes, spec_mask)
        if sum(lens) != md.num_prefill_tokens:
            raise RuntimeError(
                f"qla-serving: the prefill rows derived from vLLM's metadata hold {sum(lens)} tokens "
                f"but vLLM counts {md.num_prefill_tokens}; this vLLM splits batches differently from the "
                "versions the plugin supports"
            )
        state_indices = md.prefill_state_indices
        has_initial = md.prefill_has_initial_state
        if state_indices is None or has_initial is None or state_indices.shape[0] != len(lens):
            raise RuntimeError(
                "qla-serving: vLLM's GDN metadata has no per-prefill state indices matching its prefill "
                "rows; this vLLM is not supported by the plugin"
            )
        rows = None
        if 0 in lens:
            # Zero-length rows (padding) own no tokens; dropping them keeps every planned
            # sequence on a distinct, real slot.
            keep = [i for i, L in enumerate(lens) if L > 0]
            rows = _to_device(keep, torch.int64, state_indices.device)
            state_indices = state_indices.index_select(0, rows)
            has_initial = has_initial.index_select(0, rows)
            lens = [L for L in lens if L > 0]
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
        md.qla_plan = cached_plan(cu, m.query_start_loc.device, self.qla_num_v_heads)
        # packed once per step: on a speculative server vLLM's indices are a block-table column
        md.qla_prefill_state_indices = state_indices.contiguous()
        md.qla_prefill_has_initial_state = has_initial.contiguous()
        md.qla_prefill_rows = rows

    def update_block_table(self, metadata, blk_table, slot_mapping):  # vLLM >= 0.31
        """vLLM's re-gather of another KV-cache group's state indices, ours re-derived too.

        (vLLM 0.31-0.32 only reuses metadata this way for its own exact builder class, so this
        is a safeguard should that change.)"""
        new = super().update_block_table(metadata, blk_table, slot_mapping)
        if isinstance(new, QlaGDNAttentionMetadata) and new.qla_plan is not None:
            idx = new.prefill_state_indices
            new.qla_prefill_state_indices = (idx.contiguous() if new.qla_prefill_rows is None
                                             else idx.index_select(0, new.qla_prefill_rows))
        return new


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without waiting for the copy (pinned staging on CUDA)."""
    t = torch.tensor(values, dtype=dtype, pin_memory=torch.device(device).type == "cuda")
    return t.to(device, non_blocking=True)


class QlaGDNAttentionBackend(GDNAttentionBackend):
    """vLLM's GDN backend with :class:`QlaGDNAttentionMetadataBuilder` as its builder."""

    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return QlaGDNAttentionMetadataBuilder
