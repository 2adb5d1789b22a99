"""The GDN layer and chunk op vLLM instantiates once the plugin is registered.

``register()`` puts :class:`QlaGatedDeltaNetAttention` in place of vLLM's
``QwenGatedDeltaNetAttention`` (``PluggableLayer.register_oot``) and
:class:`QlaChunkGatedDeltaRule` in place of ``ChunkGatedDeltaRule`` (``CustomOp.register_oot``).
Both are subclasses that behave exactly like vLLM's classes unless ``flashqla`` is
requested, so registering them is harmless for every other configuration.

With ``flashqla`` requested and supported, the layer's core (``_forward_core``, what vLLM's
``qwen_gdn_attention_core`` custom op calls) keeps vLLM's causal convolution and input
preparation and replaces the recurrence:

* prefill: :func:`qla_serving.chunk_gated_delta_rule_pool` on vLLM's ssm state tensor in
  place (vLLM's per-prefill state indices and has-initial-state; no gather/scatter), with the
  step's plan from :mod:`.metadata`;
* decode: :func:`qla_serving.gated_delta_rule_decode` in place;
* speculative verify: the same decode op, reading the state of the last accepted token and
  returning the state after every draft token, which goes to the slot vLLM keeps for it.

Prefix caching: vLLM (0.26-0.32) caches a Qwen GDN layer in "align" mode; the state a step
ends with is written to the slot vLLM's metadata names, which is what the in-place prefill
does, so the cached blocks hold the same states vLLM's FlashInfer and Triton paths leave.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    ChunkGatedDeltaRule,
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, is_conv_state_dim_first

import qla_serving
from qla_serving import backend
from qla_serving.constants import MAX_DECODE_TOKENS
from qla_serving.ops.gated_delta_rule.naive import gdn_gate_ref

from . import support, warmup
from .args import BACKEND_NAME, CONFIG_KEY, flashqla_requested
from .metadata import VLLM_NULL_BLOCK_ID, QlaGDNAttentionBackend, QlaGDNAttentionMetadata

logger = logging.getLogger("vllm.qla_serving")


def _rows(x: torch.Tensor, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[:first]`` and ``x[first:end]`` in one view op (each slice is a microsecond or two of
    host time, in every layer of an eager step). For inputs only: autograd forbids writing in
    place into the views of a multi-view op."""
    rest = x.shape[0] - end
    parts = x.split_with_sizes([first, end - first, rest] if rest else [first, end - first])
    return parts[0], parts[1]


_announced = False

# Set while a QlaGatedDeltaNetAttention runs vLLM's constructor: whether that layer will run on
# qla-serving, so the chunk op it builds knows (vLLM builds the op inside the constructor).
_building_active_layer: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "qla_building_active_layer", default=False)


class QlaChunkGatedDeltaRule(ChunkGatedDeltaRule):
    """vLLM's chunk op, told about ``flashqla``.

    * Inside a layer that runs on qla-serving the op is never called: it skips vLLM's backend
      resolution (whose log would name a kernel that does not run) and records ``flashqla``.
    * Inside a layer that fell back, it resolves vLLM's backend as for the default ("auto"),
      so the layer runs exactly what vLLM runs by default (vLLM's resolver would otherwise
      read the unknown name as a request for Triton).
    """

    def __init__(self) -> None:
        vllm_config = get_current_vllm_config()
        extra = getattr(vllm_config, "additional_config", None)
        if not flashqla_requested(vllm_config) or not isinstance(extra, dict):
            super().__init__()
            return
        if _building_active_layer.get():
            CustomOp.__init__(self)
            self.gdn_prefill_backend = BACKEND_NAME
            self._forward_method = self.forward_native
            return
        extra[CONFIG_KEY] = "auto"
        try:
            super().__init__()
        finally:
            extra[CONFIG_KEY] = BACKEND_NAME


def _layer_metadata(prefix: str):
    """This layer's GDN metadata for the current step, or None (profiling/warm-up run)."""
    raw = get_forward_context().attn_metadata
    if not isinstance(raw, dict):
        return None
    return raw.get(prefix)


def refuse_batch_invariant_mode() -> None:
    """Raise under vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``), as vLLM does for its own
    GDN backends (none declares ``supports_batch_invariance``; vLLM's mamba backend selector raises).
    Our layer names its backend class itself and so never passes that selector: the refusal is kept
    here. Our kernels give a sequence the same bits in any one call (``QLA_BATCH_INVARIANT=1`` or
    ``QLA_CP_PER_SEQUENCE=1`` for the prefill), but a prompt that chunked prefill cuts where the step's
    token budget ends continues from the state pool there and rounds otherwise (docs/e2e.md,
    "Batch invariance")."""
    from vllm import envs

    if envs.VLLM_BATCH_INVARIANT:
        raise RuntimeError(
            "qla-serving: --linear-attn-backend flashqla does not support VLLM_BATCH_INVARIANT=1, like "
            "vLLM's own GDN backends: a prompt cut by chunked prefill at a place that follows the batch "
            "continues from the state pool and rounds differently. Unset VLLM_BATCH_INVARIANT; "
            "QLA_BATCH_INVARIANT=1 or QLA_CP_PER_SEQUENCE=1 make the GDN kernels give a sequence the same "
            "bits in any batch of one step"
        )


class QlaGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """vLLM's Qwen3-Next / Qwen3.5 GDN layer with its recurrence on qla-serving's ops.

    Attributes:
        qla_requested: the user asked for ``flashqla``.
        qla_active: ... and this layer runs on qla-serving (otherwise it is vLLM's layer,
            unchanged, on vLLM's default backend).
    """

    def __init__(self, config, vllm_config, prefix: str = "", *args, **kwargs) -> None:
        requested = flashqla_requested(vllm_config)
        if requested:
            refuse_batch_invariant_mode()
        active = requested and support.decide(self._qla_unsupported_reason(config, vllm_config))
        token = _building_active_layer.set(active)
        try:
            super().__init__(config, vllm_config, prefix, *args, **kwargs)
        finally:
            _building_active_layer.reset(token)
        self.qla_requested = requested
        self.qla_active = active
        spec = vllm_config.speculative_config
        self.qla_num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
        # decided once, as the warm-up's kernel set was (QLA_PREFILL_PACKED)
        self.qla_packed_prefill = backend.packed_prefill()
        self.qla_bound_launch = backend.bound_launches()
        if active:
            # vLLM >= 0.28 can send (speculative) decode to a fused CUDA kernel that bypasses
            # _forward_core (the flag is enable_fused_gdn_decode in 0.28-0.31,
            # enable_fused_gdn_spec_decode in 0.32); with flashqla every step goes through
            # _forward_core.
            for flag in ("enable_fused_gdn_decode", "enable_fused_gdn_spec_decode"):
                if hasattr(self, flag):
                    setattr(self, flag, False)
            self.enable_packed_recurrent_decode = False
            global _announced
            if not _announced:
                _announced = True
                inputs = ("vLLM's conv output and gate inputs, in place" if self.qla_packed_prefill
                          else "vLLM's fused_post_conv_prep output")
                launches = ("a step's later GDN layers rerun the first one's bound launches (QLA_BOUND_LAUNCH=1)"
                            if self.qla_bound_launch else "every GDN layer calls the ops")
                fresh = ("; a new one-token prompt behind a prefill row runs on the decode kernel"
                         if backend.fresh_rows_on_decode() else
                         "; a new one-token prompt behind a prefill row keeps the prefill's answer (QLA_FRESH_ON_DECODE=0)")
                logger.info("qla-serving: GDN layers run on flashqla (prefill, decode, speculative verify); "
                            "the prefill reads %s; %s%s%s", inputs, launches, fresh, backend.batch_invariant_note())

    @staticmethod
    def _qla_unsupported_reason(config, vllm_config) -> str | None:
        """Why this layer cannot run on qla-serving, from the configs alone (before vLLM's
        constructor, so the chunk op it builds knows)."""
        if os.environ.get("QLA_FORCE_REFERENCE") == "1":
            return None  # run the integration on the ops' PyTorch reference (any device, e.g. CPU tests)
        cache = vllm_config.cache_config
        _, state_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
        reason = support.unsupported_reason(
            vllm_config.device_config.device, config.linear_key_head_dim, config.linear_value_head_dim,
            vllm_config.model_config.dtype, state_dtype,
        )
        if reason is not None:
            return reason
        spec = vllm_config.speculative_config
        num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
        if num_spec + 1 > MAX_DECODE_TOKENS:
            return (f"{num_spec} speculative tokens verify {num_spec + 1} tokens per sequence; the decode op "
                    f"takes 1 to {MAX_DECODE_TOKENS}")
        # every kernel the layer will call: in a precompiled library, or TileLang to compile it.
        # vLLM creates A_log in float32 and dt_bias in the model dtype.
        tp = vllm_config.parallel_config.tensor_parallel_size
        dtype = vllm_config.model_config.dtype
        return backend.missing_kernels_reason(warmup.kernel_specs(
            config.linear_num_key_heads // tp, config.linear_num_value_heads // tp, dtype, state_dtype,
            torch.float32, dtype, num_spec))

    def get_attn_backend(self):
        """vLLM's GDN backend whose metadata builder also plans qla-serving's prefill."""
        if self.qla_requested:
            return QlaGDNAttentionBackend
        return super().get_attn_backend()

    # ------------------------------------------------------------------ forward

    def _forward_core(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                      core_attn_out: torch.Tensor):
        """Conv + recurrence of one step (what vLLM's ``qwen_gdn_attention_core`` calls).

        Args:
            mixed_qkv: ``[num_tokens, (2 * H + HV) * D]`` — projected q, k, v before the conv.
            b, a: ``[num_tokens, HV]`` — write-strength and decay inputs of the gate.
            core_attn_out: ``[num_tokens, HV, V]`` — written in place.
        """
        if not self.qla_active:
            return super()._forward_core(mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=core_attn_out)
        md = _layer_metadata(self.prefix)
        if md is None:
            # vLLM's profiling run (no metadata) precedes serving: compile our kernels now.
            warmup.warm_up_layer(self, mixed_qkv)
            return
        self._qla_forward(md, mixed_qkv, b, a, core_attn_out)

    def _qla_forward(self, md, mixed_qkv, b, a, core_attn_out) -> None:
        if getattr(md, "checkpoint", None) is not None:
            raise NotImplementedError(
                "qla-serving: vLLM asked this GDN layer to export a mid-prefill checkpoint; the plugin "
                "supports vLLM's 'align' prefix caching without prefill checkpoints (vLLM <= 0.32)"
            )
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        ssm_state = self.kv_cache[1]
        if getattr(md, "qla_resume_src", None) is not None:
            self._qla_resume(conv_state, ssm_state, md)
        n = md.num_actual_tokens
        if mixed_qkv.shape[0] != n:  # the batch is padded (CUDA graphs): only the step's tokens
            mixed_qkv, b, a = mixed_qkv[:n], b[:n], a[:n]
        spec = md.spec_sequence_masks is not None
        only_spec = spec and md.num_prefills == 0 and md.num_decodes == 0

        if spec and not only_spec:
            qkv_spec = mixed_qkv.index_select(0, md.spec_token_indx)
            a_spec, b_spec = a.index_select(0, md.spec_token_indx), b.index_select(0, md.spec_token_indx)
            qkv_ns = mixed_qkv.index_select(0, md.non_spec_token_indx)
            a_ns, b_ns = a.index_select(0, md.non_spec_token_indx), b.index_select(0, md.non_spec_token_indx)
        elif only_spec:
            qkv_spec, a_spec, b_spec = mixed_qkv, a, b
            qkv_ns = a_ns = b_ns = None
        else:
            qkv_spec = a_spec = b_spec = None
            qkv_ns, a_ns, b_ns = mixed_qkv, a, b

        # 1. causal convolution: vLLM's kernels (conv state updated in place by them).
        if spec:
            qkv_spec = self._qla_conv_spec(qkv_spec, conv_state, md)
        if md.num_prefills > 0:
            qkv_ns = self._qla_conv_prefill(qkv_ns, conv_state, md)
        elif md.num_decodes > 0:
            qkv_ns = self._qla_conv_decode(qkv_ns, conv_state, md)

        # 2. recurrence. Without speculative rows the outputs land straight in core_attn_out
        # (decodes first, then prefills: vLLM's order); with them, they are scattered back.
        o_spec = self._qla_spec_decode(qkv_spec, a_spec, b_spec, ssm_state, md) if spec else None
        o_ns = None
        if md.num_prefills > 0:
            peel_decodes = not spec and md.num_decodes > 0
            nd = md.num_decode_tokens if peel_decodes else 0
            end = nd + md.num_prefill_tokens
            (x_d, x_p), (a_d, a_p), (b_d, b_p) = (_rows(t, nd, end) for t in (qkv_ns, a_ns, b_ns))
            if peel_decodes:
                self._qla_decode(x_d, a_d, b_d, ssm_state, md.non_spec_state_indices_tensor[: md.num_decodes],
                                 core_attn_out[:nd], md)
            # (outputs are written in place: plain slices, taken as they are written)
            out = core_attn_out[nd:end] if not spec else None
            o_ns = self._qla_prefill(x_p, a_p, b_p, ssm_state, md, out)
            if md.qla_fresh_prefill_tokens is not None:  # (the builder sets it on steps without drafts only)
                self._qla_fresh_rows_on_decode(qkv_ns, a_ns, b_ns, ssm_state, md, core_attn_out)
        elif md.num_decodes > 0:
            # Pure decode: in serving a FULL CUDA graph replays this (two kernels per layer: vLLM's
            # conv update, then our decode reading the conv output and vLLM's slots in place).
            nd = md.num_decode_tokens
            slots = md.non_spec_state_indices_tensor
            if qkv_ns.shape[0] == nd and slots.shape[0] == nd and core_attn_out.shape[0] == nd:
                # every row a decode (eager steps): the tensors as they are, no slicing op
                self._qla_decode(qkv_ns, a_ns, b_ns, ssm_state, slots, core_attn_out, md)
            else:
                x_d, a_d, b_d = (_rows(t, 0, nd)[1] for t in (qkv_ns, a_ns, b_ns))
                self._qla_decode(x_d, a_d, b_d, ssm_state, slots[:nd], core_attn_out[:nd], md)

        if spec:
            if only_spec:
                core_attn_out[: o_spec.shape[0]] = o_spec
            else:
                core_attn_out.index_copy_(0, md.spec_token_indx, o_spec)
                if o_ns is not None:
                    core_attn_out.index_copy_(0, md.non_spec_token_indx, o_ns)

    def _qla_resume(self, conv_state, ssm_state, md) -> None:
        """Rows without drafts after a step that accepted some (speculative servers): each one's
        state, at block-table column ``num_accepted - 1``, and its conv window, at the same
        column offset, move to column 0 and offset 0, where this step's prefill and decode read.
        A row that accepted one token copies onto itself."""
        src, dst = md.qla_resume_src, md.qla_resume_dst
        ssm_state.index_copy_(0, dst, ssm_state.index_select(0, src))
        rows = conv_state.index_select(0, dst)  # [R, dim, W - 1 + num_spec]
        cols = md.qla_resume_conv_cols
        rows[:, :, : cols.shape[-1]] = rows.gather(2, cols.expand(-1, rows.shape[1], -1))
        conv_state.index_copy_(0, dst, rows)

    # ------------------------------------------------------------- convolution

    def _conv_weights(self) -> torch.Tensor:
        w = self.conv1d.weight
        return w.view(w.size(0), w.size(2))

    def _qla_conv_prefill(self, x, conv_state, md):
        """Varlen causal conv over all non-speculative rows (decodes are length-1 rows)."""
        if x.is_cuda:
            from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

            return causal_conv1d_fn(
                x.transpose(0, 1), self._conv_weights(), self.conv1d.bias, activation=self.activation,
                conv_states=conv_state, has_initial_state=md.has_initial_state,
                cache_indices=md.non_spec_state_indices_tensor, query_start_loc=md.non_spec_query_start_loc,
                metadata=md,
            ).transpose(0, 1)
        try:  # vLLM's PyTorch conv: causal_conv1d_torch in 0.26, causal_conv1d_fn_cpu from 0.27
            from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_torch
        except ImportError:
            from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
                causal_conv1d_fn_cpu as causal_conv1d_torch,
            )

        return causal_conv1d_torch(
            x.transpose(0, 1), self._conv_weights(), self.conv1d.bias, conv_states=conv_state,
            query_start_loc=md.non_spec_query_start_loc, cache_indices=md.non_spec_state_indices_tensor,
            has_initial_state=md.has_initial_state, activation=self.activation,
        ).transpose(0, 1)

    def _qla_conv_decode(self, x, conv_state, md):
        """One-token conv update of every decode row."""
        idx = md.non_spec_state_indices_tensor[: md.num_actual_tokens]
        if x.is_cuda:
            from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

            return causal_conv1d_update(x, conv_state, self._conv_weights(), self.conv1d.bias, self.activation,
                                        conv_state_indices=idx, validate_data=True)
        if self.qla_num_spec:
            # vLLM's PyTorch update keeps the newest columns of a conv state with room for drafts,
            # its CUDA kernels (and the prefill) the window at offset 0: the CPU path keeps the latter
            N = idx.shape[0]
            return conv_update_spec_torch(x[:N], conv_state, self._conv_weights(), self.conv1d.bias,
                                          self.activation, idx, torch.ones(N, dtype=torch.int32),
                                          torch.arange(N + 1, dtype=torch.int32))
        from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_torch

        rows = idx.long()
        state = conv_state[rows].contiguous()
        y = causal_conv1d_update_torch(x.unsqueeze(-1), state, self._conv_weights(), self.conv1d.bias,
                                       activation=self.activation).squeeze(-1)
        conv_state[rows] = state
        return y.to(x.dtype)  # vLLM's PyTorch update returns the conv's compute dtype

    def _qla_conv_spec(self, x, conv_state, md):
        idx = md.spec_state_indices_tensor
        return self._qla_conv_update_spec(x, conv_state, idx[:, 0][: md.num_spec_decodes], md.num_accepted_tokens,
                                          md.spec_query_start_loc)

    def _qla_conv_update_spec(self, x, conv_state, slots, accepted, query_start_loc):
        """vLLM's speculative conv update: row ``i`` (tokens ``query_start_loc[i]..[i+1]`` of ``x``)
        reads its window at offset ``accepted[i] - 1`` of slot ``slots[i]``'s conv state, which
        then holds that window's last ``W - 2`` columns followed by the row's tokens."""
        num_spec = self.qla_num_spec
        if x.is_cuda:
            from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

            return causal_conv1d_update(
                x, conv_state, self._conv_weights(), self.conv1d.bias, self.activation,
                conv_state_indices=slots, num_accepted_tokens=accepted, query_start_loc=query_start_loc,
                max_query_len=num_spec + 1, validate_data=False,
            )
        return conv_update_spec_torch(x, conv_state, self._conv_weights(), self.conv1d.bias, self.activation,
                                      slots, accepted, query_start_loc)

    # --------------------------------------------------------------- recurrence

    def _qkv_views(self, x, *rows):
        """``[L, qkv_dim]`` (the conv output, any row stride) -> q, k ``[*rows, H, K]`` and v
        ``[*rows, HV, V]`` as views of it: the decode op reads them in place."""
        rows = rows or (x.shape[0],)
        H, HV = self.num_k_heads // self.tp_size, self.num_v_heads // self.tp_size
        K, V = self.head_k_dim, self.head_v_dim
        q, k, v = x.split_with_sizes([H * K, H * K, HV * V], dim=-1)
        return q.view(*rows, H, K), k.view(*rows, H, K), v.view(*rows, HV, V)

    def _split_qkv(self, x):
        """``[L, qkv_dim]`` -> contiguous q, k ``[L, H, K]`` and v ``[L, HV, V]`` (one copy each), for
        the CPU reference prefill, whose op takes contiguous inputs."""
        return tuple(t.contiguous() for t in self._qkv_views(x))

    def _qla_prefill(self, x, a, b, ssm_state, md: QlaGDNAttentionMetadata, out):
        """Chunked prefill of the planned sequences, state in ``ssm_state`` in place."""
        if not isinstance(md, QlaGDNAttentionMetadata) or md.qla_plan is None:
            raise RuntimeError(
                "qla-serving: the GDN metadata carries no prefill plan; the layer's attention backend is "
                "not qla-serving's (was the plugin registered in this process?)"
            )
        if self.qla_packed_prefill:
            # the conv output and the gate inputs as vLLM has them: the kernels split, normalise
            # and gate (no fused_post_conv_prep pass)
            launch, key, holder = self._qla_bound("prefill", md, x, a, b, out, ssm_state)
            if launch is not None:
                launch((x.data_ptr(), a.data_ptr(), b.data_ptr(), self.A_log.data_ptr(), self.dt_bias.data_ptr(),
                        ssm_state.data_ptr(), out.data_ptr()), ssm_state)
                return out
            o = qla_serving.chunk_gated_delta_rule_pool_packed(
                x, a, b, self.A_log, self.dt_bias, ssm_state, md.qla_prefill_state_indices,
                num_qk_heads=self.num_k_heads // self.tp_size, has_initial_state=md.qla_prefill_has_initial_state,
                scale=self.head_k_dim**-0.5, plan=md.qla_plan, out=out, bind=holder,
            )
            if holder:
                md.qla_bound[key] = holder["prefill"]
            return o
        q, k, v, g, beta, l2_in_kernel = self._qla_prefill_inputs(x, a, b)
        return qla_serving.chunk_gated_delta_rule_pool(
            q, k, v, g, beta, ssm_state, md.qla_prefill_state_indices,
            has_initial_state=md.qla_prefill_has_initial_state, scale=self.head_k_dim**-0.5,
            use_qk_l2norm_in_kernel=l2_in_kernel, plan=md.qla_plan, out=out,
        )

    def _qla_prefill_inputs(self, x, a, b):
        """q, k, v, g, beta of the prefill rows from the conv output and the gate inputs (the
        engine's preparation, not ours), and whether q and k still need their L2 norm."""
        if x.is_cuda:
            from vllm.third_party.flash_linear_attention.ops import fused_post_conv_prep

            # vLLM's own fused split + L2 norm + gate: the same preparation its backends get.
            q, k, v, g, beta = fused_post_conv_prep(
                conv_output=x, a=a, b=b, A_log=self.A_log, dt_bias=self.dt_bias,
                num_k_heads=self.num_k_heads // self.tp_size, head_k_dim=self.head_k_dim,
                head_v_dim=self.head_v_dim, apply_l2norm=True, output_g_exp=False,
            )
            return q, k, v, g, beta, False
        q, k, v = self._split_qkv(x)
        g, beta = gdn_gate_ref(a, b, self.A_log, self.dt_bias, dtype=torch.float32)
        return q, k, v, g, beta, True

    def _qla_decode(self, x, a, b, ssm_state, slots, out, md=None) -> None:
        """One token per row, state read and written in place at ``slots`` (vLLM's: its null
        block marks a padded row). q, k, v, a and b are read where vLLM left them (views, no
        copies); the op gets the ``[N, 1, ...]`` form it runs. With ``QLA_BOUND_LAUNCH`` a later
        layer of the step reruns the first one's bound launch on its own addresses."""
        N = x.shape[0]
        launch, key, holder = self._qla_bound("decode", md, x, a, b, out, ssm_state, slots.data_ptr(), slots.shape)
        if launch is not None:
            # q, k and v are column ranges of the conv output's rows
            q = x.data_ptr()
            k = q + (self.num_k_heads // self.tp_size) * self.head_k_dim * x.element_size()
            v = 2 * k - q
            launch((q, k, v, a.data_ptr(), b.data_ptr(), self.A_log.data_ptr(), self.dt_bias.data_ptr(),
                    ssm_state.data_ptr(), out.data_ptr()))
            return
        q, k, v = self._qkv_views(x, N, 1)
        qla_serving.gated_delta_rule_decode(
            q, k, v, a.view(N, 1, -1), b.view(N, 1, -1), self.A_log, self.dt_bias,
            ssm_state, slots, scale=self.head_k_dim**-0.5, use_qk_l2norm_in_kernel=True,
            out=out.view(N, 1, *out.shape[1:]), min_slot=VLLM_NULL_BLOCK_ID + 1, bind=holder,
        )
        if holder:
            md.qla_bound[key] = holder["decode"]

    def _qla_fresh_rows_on_decode(self, x, a, b, ssm_state, md, core_attn_out) -> None:
        """Each new one-token prompt that ran as a prefill row this step runs again on the decode
        kernel from the zero state, its output and state replacing the prefill's, as when it runs
        alone or among decodes (the conv is the same either way)."""
        tokens, slots = md.qla_fresh_prefill_tokens, md.qla_fresh_prefill_slots
        ssm_state.index_fill_(0, slots.long(), 0)
        x_f, a_f, b_f = (t.index_select(0, tokens) for t in (x, a, b))
        out_f = torch.empty(tokens.shape[0], *core_attn_out.shape[1:], dtype=core_attn_out.dtype,
                            device=core_attn_out.device)
        self._qla_decode(x_f, a_f, b_f, ssm_state, slots, out_f)
        core_attn_out.index_copy_(0, tokens, out_f)

    def _qla_bound(self, kind, md, x, a, b, out, ssm_state, *step_tensors):
        """``(launch, key, holder)`` for a ``kind`` op call of this layer with ``QLA_BOUND_LAUNCH``:
        the step's launch bound by an earlier layer of the same layout (shapes, strides and dtypes
        of x, a, b, out and the pool, the parameters' dtypes, ``step_tensors``), or None; its key
        in ``md.qla_bound``; and the dict the op binds into when there is none (None: not binding)."""
        if not self.qla_bound_launch or md is None or out is None:
            return None, None, None
        key = (kind, x.shape, x.stride(), x.dtype, a.stride(), b.stride(), out.shape, out.stride(),
               ssm_state.shape, ssm_state.stride(), ssm_state.dtype, self.A_log.dtype, self.dt_bias.dtype,
               *step_tensors)
        launch = md.qla_bound.get(key)
        if launch is not None and x.data_ptr() % 16 == 0:  # (the op checks q's alignment; it is x's)
            return launch, key, None
        return None, key, {}

    def _qla_spec_decode(self, x, a, b, ssm_state, md):
        """Speculative verify: ``T = num_spec + 1`` tokens per row.

        vLLM keeps one slot per draft position (``spec_state_indices_tensor[i, t]`` holds the
        state after token ``t``) and resumes row ``i`` from column ``num_accepted_tokens[i] - 1``.
        The decode op reads that slot, leaves the pool alone and returns every per-token state,
        which is then copied to its column's slot.
        """
        slots = md.spec_state_indices_tensor
        T = slots.shape[1]
        gather = getattr(md, "qla_spec_gather", None)
        if gather is None:
            rows = slots.shape[0]
            if x.shape[0] < rows * T:
                raise RuntimeError(f"qla-serving: {x.shape[0]} speculative tokens for {rows} rows of {T}, and no "
                                   "padding of unequal rows in the metadata")
            # Tokens past rows * T are CUDA-graph padding of the batch.
            x, a, b = x[: rows * T], a[: rows * T], b[: rows * T]
            write = slots.reshape(-1).long()
        else:
            # drafts of unequal length: each row padded to T positions (the builder's map)
            rows = md.num_spec_decodes
            slots = slots[:rows]
            x, a, b = x.index_select(0, gather), a.index_select(0, gather), b.index_select(0, gather)
            write = md.qla_spec_write
        q, k, v = self._qkv_views(x, rows, T)
        K, HV, V = q.shape[3], v.shape[2], v.shape[3]
        read_col = (md.num_accepted_tokens[:rows].long() - 1).clamp(min=0)
        read = slots.gather(1, read_col.unsqueeze(1)).squeeze(1)
        states = torch.empty(rows, T, HV, V, K, dtype=ssm_state.dtype, device=ssm_state.device)
        o = qla_serving.gated_delta_rule_decode(
            q, k, v, a.view(rows, T, HV), b.view(rows, T, HV), self.A_log, self.dt_bias,
            ssm_state, read, scale=self.head_k_dim**-0.5, use_qk_l2norm_in_kernel=True,
            intermediate_states=states, inplace_final_state=False, min_slot=VLLM_NULL_BLOCK_ID + 1,
        )
        # Padded rows (and positions past a short row's tokens) write to vLLM's null block.
        ssm_state.index_copy_(0, write, states.view(rows * T, HV, V, K))
        o = o.view(rows * T, HV, V)
        return o if gather is None else o.index_select(0, md.qla_spec_keep)


def conv_update_spec_torch(x, conv_state, weight, bias, activation, slots, accepted, query_start_loc):
    """:meth:`QlaGatedDeltaNetAttention._qla_conv_update_spec` in PyTorch (the CPU path):
    ``x [tokens, dim]``, ``conv_state [slots, dim, W - 1 + num_spec]`` updated in place,
    ``weight [dim, W]``; returns the conv output, x's dtype."""
    W = weight.shape[1]
    out = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    for i, (slot, acc) in enumerate(zip(slots.tolist(), accepted.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo or slot == VLLM_NULL_BLOCK_ID:
            continue
        window = conv_state[slot, :, acc - 1: acc - 1 + W - 1]
        tokens = x[lo:hi].T.to(conv_state.dtype)
        seq = torch.cat([window, tokens], dim=-1).float()
        y = torch.nn.functional.conv1d(seq.unsqueeze(0), weight.float().unsqueeze(1),
                                       None if bias is None else bias.float(), groups=weight.shape[0])[0]
        if activation in ("silu", "swish"):
            y = torch.nn.functional.silu(y)
        out[lo:hi] = y.T.to(x.dtype)
        kept = torch.cat([window[:, 1:], tokens], dim=-1)
        conv_state[slot, :, : kept.shape[1]] = kept
    return out


def register_layers() -> None:
    """Check vLLM's layer and backend seams, then register :class:`QlaGatedDeltaNetAttention`
    and :class:`QlaChunkGatedDeltaRule` as vLLM's out-of-tree replacements (idempotent)."""
    from vllm.model_executor.custom_op import op_registry_oot

    from . import compat

    compat.check_vllm((compat.GDN_LAYER_MODULE, compat.GDN_BACKEND_MODULE, "vllm.model_executor.custom_op"))
    # vLLM looks an out-of-tree replacement up by the replaced class's __name__.
    for base, ours in ((QwenGatedDeltaNetAttention, QlaGatedDeltaNetAttention),
                       (ChunkGatedDeltaRule, QlaChunkGatedDeltaRule)):
        current = op_registry_oot.get(base.__name__)
        if current is None:
            base.register_oot(ours)
            ours.name = base.name  # register_oot renames it; keep vLLM's op name in its records
        elif current is not ours:
            raise RuntimeError(
                f"qla-serving: another plugin already replaces vLLM's {base.__name__} with "
                f"{current.__module__}.{current.__qualname__}; two replacements cannot both run"
            )


# The plugin was registered and vLLM's GDN module imported while this module was importing it.
if sys.modules[__package__].layers_wanted:
    register_layers()
