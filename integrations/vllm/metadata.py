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

import dataclasses
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.gdn_attn import (
    GDNAttentionBackend,
    GDNAttentionMetadata,
    GDNAttentionMetadataBuilder,
)

from qla_serving.plan import PrefillPlan, plan_prefill

from .args import flashqla_requested


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
        qla_spec_uniform: with speculative rows, whether every one has ``num_spec + 1``
            tokens (host-side, so the layer knows without a sync); None without them.
        qla_bound: the step's bound launches (``QLA_BOUND_LAUNCH``), filled by its first GDN
            layer and rerun by the others: layout key -> launch.
    """

    qla_plan: PrefillPlan | None = None
    qla_prefill_state_indices: torch.Tensor | None = None
    qla_prefill_has_initial_state: torch.Tensor | None = None
    qla_prefill_rows: torch.Tensor | None = None
    qla_spec_uniform: bool | None = None
    qla_bound: dict = dataclasses.field(default_factory=dict)


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
        fields = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
        out = QlaGDNAttentionMetadata(**fields)
        if md.num_prefills > 0:
            self._attach_plan(out, common_attn_metadata, num_decode_draft_tokens_cpu)
        if md.spec_sequence_masks is not None:
            m = common_attn_metadata
            mask = self._spec_mask_cpu(md, num_decode_draft_tokens_cpu)
            lens = m.query_start_loc_cpu[: m.num_reqs + 1].diff()[mask[: m.num_reqs]]
            out.qla_spec_uniform = bool((lens == self.num_spec + 1).all())
        return out

    @staticmethod
    def _spec_mask_cpu(md, num_decode_draft_tokens_cpu):
        mask = getattr(md, "spec_sequence_masks_cpu", None)  # vLLM >= 0.31 keeps it
        if mask is None:
            mask = num_decode_draft_tokens_cpu >= 0  # what vLLM derives it from
        return mask

    def _attach_plan(self, md: QlaGDNAttentionMetadata, m, num_decode_draft_tokens_cpu) -> None:
        spec_mask_cpu = None
        if md.spec_sequence_masks is not None:
            spec_mask_cpu = self._spec_mask_cpu(md, num_decode_draft_tokens_cpu)
        lens = prefill_query_lens_cpu(m.query_start_loc_cpu, m.num_reqs, md.num_decodes, spec_mask_cpu)
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
            rows = torch.tensor(keep, dtype=torch.int64).to(state_indices.device, non_blocking=True)
            state_indices = state_indices.index_select(0, rows)
            has_initial = has_initial.index_select(0, rows)
            lens = [L for L in lens if L > 0]
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)
        md.qla_plan = cached_plan(cu, m.query_start_loc.device, self.qla_num_v_heads)
        md.qla_prefill_state_indices = state_indices
        md.qla_prefill_has_initial_state = has_initial
        md.qla_prefill_rows = rows

    def update_block_table(self, metadata, blk_table, slot_mapping):  # vLLM >= 0.31
        """vLLM's re-gather of another KV-cache group's state indices, ours re-derived too.

        (vLLM 0.31-0.32 only reuses metadata this way for its own exact builder class, so this
        is a safeguard should that change.)"""
        new = super().update_block_table(metadata, blk_table, slot_mapping)
        if isinstance(new, QlaGDNAttentionMetadata) and new.qla_plan is not None:
            idx = new.prefill_state_indices
            new.qla_prefill_state_indices = idx if new.qla_prefill_rows is None else idx.index_select(
                0, new.qla_prefill_rows)
        return new


class QlaGDNAttentionBackend(GDNAttentionBackend):
    """vLLM's GDN backend with :class:`QlaGDNAttentionMetadataBuilder` as its builder."""

    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return QlaGDNAttentionMetadataBuilder
