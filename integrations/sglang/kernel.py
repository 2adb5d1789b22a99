"""``FlashQLAGDNKernel``: SGLang's ``LinearAttnKernelBase`` on qla-serving's ops.

The kernel object only translates SGLang's tensors and metadata into the op calls:

* ``extend``  -> :func:`qla_serving.chunk_gated_delta_rule_pool` on SGLang's ``ssm_states``
  pool (``[num_slots, HV, V, K]``) at ``cache_indices``, in place, with the batch's
  :class:`~qla_serving.plan.PrefillPlan` (built once per forward batch, see :meth:`begin_batch`);
* ``decode`` -> :func:`qla_serving.gated_delta_rule_decode`, one token per sequence;
* ``target_verify`` -> the same decode op with ``T = draft tokens``, the state after every
  token written to SGLang's ``intermediate_ssm`` rows and the pool left alone (SGLang copies the
  accepted prefix's state back after acceptance).

Prefix caching: SGLang's mamba radix cache copies, for some sequences, the state at a chunk
boundary inside the extend into a cache slot. Our op writes the states after every
``mamba_chunk_size`` tokens as checkpoints when (and only when) the batch tracks such a state,
and the kernel hands SGLang the one it asks for — through the ``track_state`` snapshot buffer
(SGLang >= 0.5.22) or the per-chunk state tensor ``h`` (earlier versions).

What the kernels cannot take (a tree-shaped or ragged verify, more than 8 draft tokens) goes to
SGLang's triton kernel, the ``fallback`` the dispatcher built, with one log line per reason.

Deterministic inference (``--enable-deterministic-inference``, or an RL on-policy target, which
turns it on): the prefill plans AutoCP per sequence, so a sequence gets the same bits in any batch,
as SGLang's triton GDN kernels give it (the decode's bits never depend on the batch).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

from qla_serving import backend as qla_backend
from qla_serving.constants import CHUNK_SIZE, MAX_DECODE_TOKENS
from qla_serving.ops.gated_delta_rule import chunk_gated_delta_rule_pool, gated_delta_rule_decode
from qla_serving.plan import PrefillPlan, env_flag, plan_prefill

logger = logging.getLogger("qla_serving")

_logged: set[str] = set()


def _log_once(level: int, message: str, *args) -> None:
    key = message % args if args else message
    if key not in _logged:
        _logged.add(key)
        logger.log(level, message, *args)


@dataclass
class BatchPlan:
    """What :meth:`FlashQLAGDNKernel.begin_batch` prepared for one forward batch.

    Attributes:
        query_start_loc: the exact tensor SGLang passes to every layer's ``extend`` for this
            batch; identity (``is``) ties a layer call to its plan. Holding it keeps it alive,
            so its id cannot be reused by a later batch's tensor.
        plan: the batch's prefill plan (CPU lengths from SGLang, index tables on the device);
            None until the first layer builds it when SGLang gave no CPU lengths.
        track: some sequence's state at a chunk boundary goes to the prefix cache.
    """

    query_start_loc: torch.Tensor
    plan: PrefillPlan | None
    track: bool


#: Batches remembered per kernel object: two, so interleaved two-batch-overlap halves both hit.
_RECENT_BATCHES = 2


DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def engine_deterministic() -> bool:
    """Whether this SGLang process runs deterministic inference: the effective config where SGLang
    publishes one (``runtime_context.get_exec()``, 0.5.23), else the server arguments it publishes
    globally (``get_global_server_args()``, retired in 0.5.23), else the environment variable SGLang
    sets for its processes (``SGLANG_ENABLE_DETERMINISTIC_INFERENCE``)."""
    for read in (_deterministic_in_published_config, _deterministic_in_global_server_args):
        value = read()
        if value is not None:
            return value
    return env_flag("SGLANG_ENABLE_DETERMINISTIC_INFERENCE")


def _deterministic_in_published_config() -> bool | None:
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().deterministic.enable_deterministic_inference)
    except (ImportError, AttributeError, ValueError, RuntimeError):  # older SGLang, or not published here
        return None


def _deterministic_in_global_server_args() -> bool | None:
    try:
        from sglang.srt.server_args import get_global_server_args

        return bool(get_global_server_args().enable_deterministic_inference)
    except (ImportError, AttributeError, ValueError, RuntimeError):  # retired (0.5.23), or not set
        return None


def _as_list(x) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def _value_heads(attn_backend) -> int | None:
    """Value heads per GPU of the GDN layers, from SGLang's recurrent-state pool
    (``mamba_cache.temporal``: ``[layers, slots, HV, V, K]``); None where this SGLang keeps it
    elsewhere: the plan then goes without AutoCP."""
    pool = getattr(getattr(attn_backend, "req_to_token_pool", None), "mamba_pool", None)
    temporal = getattr(getattr(pool, "mamba_cache", None), "temporal", None)
    shape = getattr(temporal, "shape", None)
    return int(shape[-3]) if shape is not None and len(shape) >= 3 else None


class FlashQLAGDNKernel(LinearAttnKernelBase):
    """SGLang GDN kernel object running qla-serving's prefill and decode ops.

    Args:
        fallback: the ``LinearAttnKernelBase`` to hand calls our ops cannot take (the
            dispatcher's ``TritonGDNKernel``).
        phases: which of ``{"decode", "prefill", "verify"}`` the dispatcher routes here (for
            warm-up and logs; every method works whatever the set).
    """

    # extend() fills SGLang's fp32 track snapshot (track_state / track_chunk_idx) itself.
    supports_track_state_snapshot = True
    # FlashInfer's checkpoint protocol; ours is internal to extend().
    uses_state_checkpoints = False
    # The ops take contiguous q/k/v, so SGLang should split qkv into fresh tensors for verify.
    supports_strided_target_verify_qkv = False
    # SGLang's packed decode entry fuses the qkv split into a triton kernel; we take q/k/v.
    supports_packed_decode = False

    def __init__(self, fallback: LinearAttnKernelBase, phases: set[str] | frozenset[str] = frozenset()):
        self.fallback = fallback
        self.phases = frozenset(phases)
        self.track_chunk_size = CHUNK_SIZE
        self.num_v_heads: int | None = None  # from the state pool at the first batch (for AutoCP)
        # AutoCP per sequence under SGLang's deterministic inference; None: QLA_CP_PER_SEQUENCE decides
        self.cp_per_sequence: bool | None = True if engine_deterministic() else None
        # The latest extend batches, newest first, found by query_start_loc identity.
        self._batches: list[BatchPlan] = []

    # ------------------------------------------------------------------ per batch
    def begin_batch(self, attn_backend, forward_batch) -> None:
        """Build this forward batch's prefill plan from SGLang's CPU-side lengths.

        Called once per batch (after ``GDNAttnBackend.init_forward_metadata``), before any
        layer runs; every GDN layer's ``extend`` then reuses the plan. Batches whose CPU
        lengths are missing or do not describe ``query_start_loc`` (two-batch overlap splits)
        are remembered without a plan; their first layer builds it from ``query_start_loc``.

        Args:
            attn_backend: SGLang's ``GDNAttnBackend``; its ``forward_metadata`` was just set.
            forward_batch: SGLang's ``ForwardBatch``: ``forward_mode``, ``batch_size``,
                ``extend_seq_lens_cpu`` (list or CPU tensor of ``batch_size`` ints).
        """
        metadata = getattr(attn_backend, "forward_metadata", None)
        mode = forward_batch.forward_mode
        if metadata is None or not mode.is_extend() or mode.is_target_verify():
            return
        if getattr(attn_backend, "mis_metadata", None) is not None:
            return  # multi-item scoring runs its own segments (SGLang requires triton there)
        query_start_loc = getattr(metadata, "query_start_loc", None)
        if query_start_loc is None:
            return
        track = self._tracks_chunk_state(metadata)
        if track:
            self.track_chunk_size = int(getattr(attn_backend, "mamba_chunk_size", CHUNK_SIZE) or CHUNK_SIZE)
        lens = _as_list(getattr(forward_batch, "extend_seq_lens_cpu", None))
        plan = None
        if (
            lens is not None
            and len(lens) == forward_batch.batch_size
            and len(lens) + 1 == query_start_loc.shape[0]
            and getattr(forward_batch, "tbo_parent_token_range", None) is None
        ):
            cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
            if lens:
                cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
            every = self.track_chunk_size if track and self.track_chunk_size % CHUNK_SIZE == 0 else None
            if self.num_v_heads is None:
                self.num_v_heads = _value_heads(attn_backend)
            plan = plan_prefill(cu, device=query_start_loc.device, checkpoint_every=every,
                                num_v_heads=self.num_v_heads, cp_per_sequence=self.cp_per_sequence)
        self._remember(BatchPlan(query_start_loc=query_start_loc, plan=plan, track=track))

    def _remember(self, batch: BatchPlan) -> BatchPlan:
        self._batches = [batch, *self._batches][:_RECENT_BATCHES]
        return batch

    def _batch_for(self, query_start_loc: torch.Tensor) -> BatchPlan | None:
        for batch in self._batches:
            if batch.query_start_loc is query_start_loc:
                return batch
        return None

    @staticmethod
    def _tracks_chunk_state(metadata) -> bool:
        """SGLang will copy some sequence's mid-extend chunk-boundary state to the prefix cache."""
        if not getattr(metadata, "has_mamba_track_mask", False):
            return False
        h_src = getattr(metadata, "track_ssm_h_src", None)
        return h_src is not None and h_src.numel() > 0

    def _plan_for(self, query_start_loc: torch.Tensor, checkpoint_every: int | None,
                  batch: BatchPlan | None = None) -> PrefillPlan:
        """The batch's plan (with checkpoints every ``checkpoint_every`` tokens if asked);
        ``batch``: the caller's :meth:`_batch_for` of ``query_start_loc``, if it has it."""
        if batch is None:
            batch = self._batch_for(query_start_loc)
        if batch is None:  # a batch begin_batch did not see (an extend outside SGLang's GDN backend)
            batch = self._remember(BatchPlan(query_start_loc=query_start_loc, plan=None, track=False))
        if batch.plan is not None:
            if checkpoint_every is None or batch.plan.checkpoint_every == checkpoint_every:
                return batch.plan
            cu = batch.plan.cu_seqlens_cpu
        else:
            _log_once(
                logging.INFO,
                "qla-serving: building a prefill plan from query_start_loc "
                "(no CPU lengths for this batch; one host sync per batch)",
            )
            cu = query_start_loc.cpu()
        batch.plan = plan_prefill(cu, device=query_start_loc.device, checkpoint_every=checkpoint_every,
                                  num_v_heads=self.num_v_heads, cp_per_sequence=self.cp_per_sequence)
        return batch.plan

    # ------------------------------------------------------------------ extend
    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        inplace_update: bool = True,
        **kwargs,
    ) -> tuple:
        """Chunked prefill of a varlen batch, state read from and written to the pool in place.

        Args:
            q, k: ``[1, T, H, K]`` (or ``[T, H, K]``), the activation dtype; any strides.
            v: ``[1, T, HV, V]`` (or ``[T, HV, V]``).
            g: ``[1, T, HV]`` float32 — log decay from SGLang's ``fused_gdn_gating``.
            beta: ``[1, T, HV]`` float32 — write strength.
            ssm_states: ``[num_slots, HV, V, K]`` — this layer's state pool (float32 or bf16).
            cache_indices: ``[N]`` int32 — the slot of each sequence; the state there is the
                initial state (SGLang zeroes a new request's slot) and becomes the final one.
            query_start_loc: ``[N + 1]`` int32 on the device — sequence offsets; tokens past
                ``query_start_loc[-1]`` (padding) get zero output.
            inplace_update: False only in SGLang's multi-item scoring, which it runs on triton.
            track_state: (kwarg) ``[N, HV, V, K]`` float32 or None — receives, for rows with
                ``track_chunk_idx[i] >= 0``, the state entering that chunk of sequence ``i``.
            track_chunk_idx: (kwarg) ``[N]`` int32, ``-1`` for rows SGLang does not track.
            output: (kwarg) ``[1, T, HV, V]`` buffer SGLang would copy the result into; written
                directly (and returned) when contiguous in q's dtype.

        Returns:
            ``(o [1, T, HV, V], None, h)``: ``h`` is ``[1, num_chunks, HV, V, K]`` (the state
            entering every 64-token chunk, in the pool's dtype) when an SGLang older than 0.5.22
            tracks a chunk state in this batch, else None.
        """
        if not inplace_update:
            return self.fallback.extend(
                q,
                k,
                v,
                g,
                beta,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                query_start_loc=query_start_loc,
                inplace_update=inplace_update,
                **kwargs,
            )
        H, K = q.shape[-2], q.shape[-1]
        HV, V = v.shape[-2], v.shape[-1]
        total = q.numel() // (H * K)
        track_state = kwargs.get("track_state")
        track_chunk_idx = kwargs.get("track_chunk_idx")
        batch = self._batch_for(query_start_loc)
        want_h = track_state is None and batch is not None and batch.track
        want_states = track_state is not None or want_h
        every = self.track_chunk_size if want_states else None
        if every is not None and every % CHUNK_SIZE:
            _log_once(
                logging.WARNING,
                "qla-serving: mamba_chunk_size=%d is not a multiple of %d; batches "
                "that track prefix-cache states run on SGLang's triton kernel",
                every,
                CHUNK_SIZE,
            )
            return self.fallback.extend(
                q,
                k,
                v,
                g,
                beta,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                query_start_loc=query_start_loc,
                **kwargs,
            )
        plan = self._plan_for(query_start_loc, every, batch)
        n_tok, N = plan.total_tokens, plan.num_seqs
        if n_tok > total:
            raise ValueError(f"query_start_loc covers {n_tok} tokens but q has {total}")

        def flat(x: torch.Tensor, inner: tuple[int, ...]) -> torch.Tensor:
            x = x.reshape(total, *inner)
            return (x if n_tok == total else x[:n_tok]).contiguous()

        slots = cache_indices if cache_indices.shape[0] == N else cache_indices[:N]

        states = None
        if want_states:
            # Row i: the state before sequence i (the pool is overwritten in place); then
            # the checkpoints after every `every` tokens, sequence by sequence.
            states = torch.empty(
                N + plan.num_checkpoints, HV, V, K, dtype=ssm_states.dtype, device=ssm_states.device
            )
            states[:N] = ssm_states[slots.long()]
        output = kwargs.get("output")
        # SGLang's preallocated layer output (``linear_attn_output``): writing into it saves
        # SGLang a copy. Used when it is exactly the op's output layout.
        out = None
        if (
            output is not None
            and n_tok == total
            and tuple(output.shape) == (1, total, HV, V)
            and output.dtype == q.dtype
            and output.device == q.device
            and output.is_contiguous()
        ):
            out = output[0]
        o = chunk_gated_delta_rule_pool(
            flat(q, (H, K)),
            flat(k, (H, K)),
            flat(v, (HV, V)),
            flat(g, (HV,)),
            flat(beta, (HV,)),
            state_pool=ssm_states,
            state_indices=slots,
            plan=plan,
            scale=K**-0.5,
            use_qk_l2norm_in_kernel=True,
            checkpoints=states[N:] if states is not None else None,
            out=out,
        )
        if n_tok < total:
            padded = o.new_zeros(total, HV, V)
            padded[:n_tok] = o
            o = padded
        h = None
        if track_state is not None and track_chunk_idx is not None:
            track_state.copy_(states[self._track_rows(plan, track_chunk_idx, states.shape[0])])
        elif want_h:
            h = states[self._chunk_start_rows(plan)].unsqueeze(0)
        return o.unsqueeze(0), None, h

    @staticmethod
    def _track_rows(plan: PrefillPlan, track_chunk_idx: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Row of ``states`` holding the state entering chunk ``track_chunk_idx[i]`` of sequence i.

        Chunk 0 starts from the initial state (row i); chunk c >= 1 from checkpoint c - 1 of
        the sequence. Untracked rows (-1) read their initial state; SGLang ignores them.
        Device-side arithmetic only: no host sync.
        """
        N = plan.num_seqs
        chunk = track_chunk_idx[:N].long()
        rows = torch.arange(N, device=chunk.device)
        ckpt = N + plan.checkpoint_offsets[:N].long().to(chunk.device) + chunk - 1
        return torch.where(chunk > 0, ckpt, rows).clamp(0, num_rows - 1)

    @staticmethod
    def _chunk_start_rows(plan: PrefillPlan) -> torch.Tensor:
        """For every chunk of the batch (in order), the row of ``states`` entering it.

        Chunk 0 of sequence i starts from row i (its initial state); chunk c >= 1 from
        checkpoint c - 1 of the sequence. Derived on the device from the plan's own
        ``(sequence, chunk within sequence)`` table, once per plan.
        """
        cached = plan.extras.get("sglang_chunk_start_rows")
        if cached is None:
            seq, within = plan.chunk_indices[:, 0].long(), plan.chunk_indices[:, 1].long()
            ckpt = plan.num_seqs + plan.checkpoint_offsets.long()[seq] + within - 1
            cached = torch.where(within > 0, ckpt, seq)
            plan.extras["sglang_chunk_start_rows"] = cached
        return cached

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        """One decode token per sequence; the gate is computed in the op; the pool is updated in place.

        Args:
            q, k: ``[1, B, H, K]``; v: ``[1, B, HV, V]`` — the activation dtype, any strides.
            a, b: ``[B, HV]`` — gate inputs: ``g = -exp(A_log) softplus(a + dt_bias)``,
                ``beta = sigmoid(b)``.
            A_log, dt_bias: ``[HV]``.
            ssm_states: ``[num_slots, HV, V, K]`` — this layer's pool.
            cache_indices: ``[B]`` int32 — slot per sequence (CUDA-graph padding rows point at
                SGLang's reserved slot; ``-1`` rows are skipped).
            query_start_loc: ``[B + 1]`` — unused (one token per sequence).

        Returns:
            ``o``: ``[1, B, HV, V]`` in q's dtype.
        """
        H, K = q.shape[-2], q.shape[-1]
        HV, V = v.shape[-2], v.shape[-1]
        B = cache_indices.shape[0]
        # Views of SGLang's split conv output are read in place (the op copies only a layout its
        # kernel cannot read).
        o = gated_delta_rule_decode(
            q.reshape(B, H, K),
            k.reshape(B, H, K),
            v.reshape(B, HV, V),
            a.reshape(B, HV),
            b.reshape(B, HV),
            A_log,
            dt_bias,
            state_pool=ssm_states,
            state_indices=cache_indices,
            scale=K**-0.5,
            use_qk_l2norm_in_kernel=True,
        )
        return o.view(1, B, HV, V)

    # ------------------------------------------------------------------ target verify
    def target_verify(
        self,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        intermediate_states_buffer: torch.Tensor | None = None,
        intermediate_state_indices: torch.Tensor | None = None,
        cache_steps: int | None = None,
        retrieve_parent_token: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """Speculative verify of a linear draft chain: ``T = cache_steps`` tokens per sequence.

        The pool is not updated; the state after each draft token goes to
        ``intermediate_states_buffer[intermediate_state_indices[i], t]`` so SGLang can copy
        the accepted prefix's state into the pool.

        Args:
            A_log, dt_bias: ``[HV]``.
            q, k: ``[1, N*T, H, K]`` or ``[N*T, H, K]``; v: ``[1, N*T, HV, V]`` or ``[N*T, HV, V]``.
            a, b: ``[N*T, HV]``.
            ssm_states: ``[num_slots, HV, V, K]`` — read only here.
            cache_indices: ``[>= N]`` int32 — slot per sequence (``-1``: padding row, skipped).
            query_start_loc: ``[N + 1]`` — ``arange(0, N*T + 1, T)`` for a uniform chain.
            intermediate_states_buffer: ``[rows, T, HV, V, K]`` in the pool's dtype.
            intermediate_state_indices: ``[>= N]`` int32 — the buffer row of each sequence
                (SGLang's positional ``arange`` unless ``stable_rows``).
            cache_steps: ``T``, the draft tokens per sequence.
            retrieve_parent_token: tree links (EAGLE top-k > 1): the tree goes to triton.
            stable_rows: (kwarg) rows are request-pool rows rather than ``arange(N)``.

        Returns:
            ``o``: v's shape, q's dtype.
        """
        N = query_start_loc.shape[0] - 1
        H, K = q.shape[-2], q.shape[-1]
        HV, V = v.shape[-2], v.shape[-1]
        T = cache_steps
        tokens = q.numel() // (H * K)
        reason = None
        if retrieve_parent_token is not None:
            reason = "tree-shaped drafts (EAGLE top-k > 1)"
        elif intermediate_states_buffer is None or T is None:
            reason = "no intermediate state buffer"
        elif tokens != N * T:
            reason = "ragged verify layout (draft lengths differ per request)"
        elif not 1 <= T <= MAX_DECODE_TOKENS:
            reason = f"{T} draft tokens (the decode op takes 1 to {MAX_DECODE_TOKENS})"
        if reason is not None:
            _log_once(
                logging.INFO, "qla-serving: target_verify with %s runs on SGLang's triton kernel", reason
            )
            return self.fallback.target_verify(
                A_log=A_log,
                dt_bias=dt_bias,
                q=q,
                k=k,
                v=v,
                a=a,
                b=b,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                query_start_loc=query_start_loc,
                intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices,
                cache_steps=cache_steps,
                retrieve_parent_token=retrieve_parent_token,
                **kwargs,
            )
        if kwargs.get("stable_rows"):
            # Rows are request-pool rows: run into scratch, then scatter (an extra copy).
            inter = torch.empty(
                N,
                T,
                HV,
                V,
                K,
                dtype=intermediate_states_buffer.dtype,
                device=intermediate_states_buffer.device,
            )
        else:
            # SGLang's table is arange(N) positionally (build_verify_intermediate_state_indices),
            # so the rows are the buffer's first N: write them directly, no scatter.
            inter = intermediate_states_buffer[:N]
        o = gated_delta_rule_decode(
            q.reshape(N, T, H, K),
            k.reshape(N, T, H, K),
            v.reshape(N, T, HV, V),
            a.reshape(N, T, HV),
            b.reshape(N, T, HV),
            A_log,
            dt_bias,
            state_pool=ssm_states,
            state_indices=cache_indices[:N],
            scale=K**-0.5,
            use_qk_l2norm_in_kernel=True,
            intermediate_states=inter,
            inplace_final_state=False,
        )
        if kwargs.get("stable_rows"):
            intermediate_states_buffer.index_copy_(0, intermediate_state_indices[:N].long(), inter)
        return o.reshape(v.shape)


# ---------------------------------------------------------------------- binding to a model
_fallback_warned: set[str] = set()


def _find_linear_layer(model, num_v_heads: int):
    """A ``RadixLinearAttention``-like module of the model (for head counts and gate dtypes) whose
    value heads are ``num_v_heads``, the state pool's (per rank).

    SGLang's GDN layer (``Qwen3GatedDeltaNet``, ``Qwen3_5GatedDeltaNet``) holds the model's total
    head counts under the same names and comes first in ``modules()``; its ``RadixLinearAttention``
    child holds the per-rank ones. At TP 1 the two agree; above it only the child matches the pool.
    """
    if model is None:
        return None
    for module in model.modules():
        if all(
            hasattr(module, name) for name in ("num_k_heads", "num_v_heads", "head_k_dim", "A_log", "dt_bias")
        ) and module.num_v_heads == num_v_heads:
            return module
    return None


def kernel_device(model_runner) -> torch.device:
    device = torch.device(getattr(model_runner, "device", "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", getattr(model_runner, "gpu_id", None) or torch.cuda.current_device())
    return device


def restore_triton(dispatcher, reason: str) -> None:
    """Put SGLang's triton kernel back in every phase that held ours (the fallback)."""
    triton = dispatcher.tree_verify_kernel
    for name in ("extend_kernel", "decode_kernel", "verify_kernel"):
        if isinstance(getattr(dispatcher, name, None), FlashQLAGDNKernel):
            setattr(dispatcher, name, triton)
    dispatcher.supports_packed_decode = getattr(dispatcher.decode_kernel, "supports_packed_decode", False)


def bind_to_runner(kernel: FlashQLAGDNKernel, dispatcher, attn_backend, model_runner) -> str | None:
    """Decide, once per model runner, whether our kernels run; compile them if they do.

    Unsupported configurations (not an SM90 GPU, head dims other than 128, fp32 activations, a
    kernel in no precompiled library with no TileLang to compile it) put SGLang's triton kernel back in our phases with one warning naming
    the reason; with ``QLA_STRICT=1`` they raise :class:`qla_serving.backend.KernelUnavailable`.
    ``QLA_FORCE_REFERENCE=1`` keeps our kernel object on the PyTorch reference (debugging).

    Returns:
        The reason for the fallback, or None when our kernel stays.
    """
    pool = model_runner.req_to_token_pool.mamba_pool.mamba_cache.temporal  # [layers, slots, HV, V, K]
    HV, V, K = pool.shape[-3:]
    dtype = getattr(model_runner, "dtype", None) or torch.bfloat16
    device = kernel_device(model_runner)
    if os.environ.get("QLA_FORCE_REFERENCE") == "1":
        logger.warning("qla-serving: QLA_FORCE_REFERENCE=1, SGLang's GDN layers run the PyTorch reference")
        return None
    reason = qla_backend.unsupported_reason(device, K, V, dtype, pool.dtype)
    if reason is None:
        layer = _find_linear_layer(getattr(model_runner, "model", None), HV)
        from .warmup import warmup_kernels, warmup_specs

        config = dict(
            phases=kernel.phases,
            num_qk_heads=getattr(layer, "num_k_heads", None),
            num_v_heads=HV,
            dtype=dtype,
            pool_dtype=pool.dtype,
            gate_dtype=getattr(getattr(layer, "A_log", None), "dtype", torch.float32),
            bias_dtype=getattr(getattr(layer, "dt_bias", None), "dtype", None),
            draft_tokens=_draft_tokens(model_runner),
        )
        # every kernel the phases call: in a precompiled library, or TileLang to compile it
        reason = qla_backend.missing_kernels_reason(warmup_specs(**config))
    if reason is not None:
        message = (
            f"qla-serving: --linear-attn-backend flashqla cannot run here ({reason}); "
            "SGLang's triton GDN kernels run instead"
        )
        qla_backend.fall_back_once(message, _fallback_warned, reason, log=logger,
                                   strict_message=f"{message}. QLA_STRICT=1 forbids the fallback")
        restore_triton(dispatcher, reason)
        return reason
    warmup_kernels(device=device, **config)
    return None


def _draft_tokens(model_runner) -> int | None:
    """Tokens per sequence our verify kernel will take, or None: no speculative decoding, or more
    draft tokens than the decode op takes (each such verify goes to SGLang's triton kernel, logged
    at the call; nothing to compile for it at start)."""
    args = getattr(model_runner, "server_args", None)
    n = getattr(args, "speculative_num_draft_tokens", None)
    return int(n) if n and int(n) <= MAX_DECODE_TOKENS else None


__all__ = ["BatchPlan", "FlashQLAGDNKernel", "bind_to_runner"]
