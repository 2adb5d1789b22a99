"""FlashQLAGDNKernel called the way SGLang calls it, on the CPU (the ops' reference path),
against the float64 token-by-token oracle. SGLang's own classes build the batch metadata and
consume the prefix-cache states; pool rows the call does not own must stay bit-identical."""

import inspect

import pytest
import torch
from helpers import max_rel_err, verify_ref

from qla_serving.constants import MAX_DECODE_TOKENS
from qla_serving.ops.gated_delta_rule.naive import (
    gdn_gate_ref,
    recurrent_decode_ref,
    recurrent_gated_delta_rule_ref,
)

H, HV, K, V = 2, 4, 128, 128
NUM_SLOTS = 9
OUT_TOL = 2e-2  # bf16 outputs
STATE_TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}


def split_qkv(tokens: int, dtype=torch.bfloat16):
    """q, k, v as SGLang's unfused path makes them: views of one mixed projection (strided)."""
    mixed = torch.randn(tokens, 2 * H * K + HV * V, dtype=dtype)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    return q.view(1, tokens, H, K), k.view(1, tokens, H, K), v.view(1, tokens, HV, V)


def gate_params():
    A_log = torch.empty(HV).uniform_(-1.0, 0.5)
    dt_bias = torch.randn(HV).to(torch.bfloat16)
    return A_log, dt_bias


def make_kernel():
    from qla_serving.integrations.sglang.kernel import FlashQLAGDNKernel
    from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

    return FlashQLAGDNKernel(fallback=TritonGDNKernel(), phases={"decode", "prefill", "verify"})


def make_pool(dtype):
    return (0.1 * torch.randn(NUM_SLOTS, HV, V, K)).to(dtype)


def extend_batch(lens, slots, *, track=False, track_h_src=None):
    """SGLang's per-batch objects for an extend: ForwardBatch, ForwardMetadata, GDNAttnBackend."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import ForwardMetadata
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    total = sum(lens)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lens).cumsum(0)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lens),
        input_ids=torch.zeros(total, dtype=torch.long),
        req_pool_indices=torch.arange(len(lens)),
        seq_lens=torch.tensor(lens),
        out_cache_loc=torch.zeros(total),
        seq_lens_sum=total,
        extend_seq_lens_cpu=list(lens),
    )
    md = ForwardMetadata(query_start_loc=qsl, mamba_cache_indices=torch.tensor(slots, dtype=torch.int32))
    if track:
        md.has_mamba_track_mask = True
        md.track_ssm_h_src = track_h_src if track_h_src is not None else torch.tensor([0])
        md.track_ssm_final_src = torch.zeros(0, dtype=torch.long)
        md.track_ssm_final_dst = torch.zeros(0, dtype=torch.long)
    backend = object.__new__(GDNAttnBackend)  # a real backend object holding this batch's metadata
    backend.forward_metadata = md
    backend.mis_metadata = None
    backend._mamba_chunk_size = 64
    return fb, md, backend


def extend_inputs(lens, pad=0):
    T = sum(lens) + pad
    q, k, v = split_qkv(T)
    a, b = torch.randn(T, HV), torch.randn(T, HV)
    A_log, dt_bias = gate_params()
    g, beta = gdn_gate_ref(a, b, A_log, dt_bias, dtype=torch.float32)  # SGLang's fused_gdn_gating
    return q, k, v, g.unsqueeze(0), beta.unsqueeze(0)


def extend_oracle(q, k, v, g, beta, init, lens):
    n = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return recurrent_gated_delta_rule_ref(
        q[0, :n],
        k[0, :n],
        v[0, :n],
        g[0, :n],
        beta[0, :n],
        scale=K**-0.5,
        initial_state=init,
        cu_seqlens=cu,
        use_qk_l2norm=True,
        checkpoint_every=64,
    )


def oracle_chunk_states(init, ckpts, lens):
    """State entering chunk c of sequence i: the initial state for c = 0, else checkpoint c - 1."""
    out, offset = [], 0
    for i, L in enumerate(lens):
        n_ckpt = L // 64
        out.append([init[i]] + [ckpts[offset + j] for j in range(n_ckpt)])
        offset += n_ckpt
    return out


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_extend_matches_oracle_in_place(pool_dtype):
    lens, slots, pad = [70, 1, 130, 64], [5, 0, 8, 3], 3
    kernel = make_kernel()
    fb, md, backend = extend_batch(lens, slots)
    kernel.begin_batch(backend, fb)
    q, k, v, g, beta = extend_inputs(lens, pad=pad)
    pool = make_pool(pool_dtype)
    before = pool.clone()
    o, last_state, h = kernel.extend(
        q,
        k,
        v,
        g,
        beta,
        ssm_states=pool,
        cache_indices=md.mamba_cache_indices,
        query_start_loc=md.query_start_loc,
    )
    ref_o, ref_final, _ = extend_oracle(q, k, v, g, beta, before[slots].double(), lens)
    n = sum(lens)
    assert o.shape == (1, n + pad, HV, V) and o.dtype == q.dtype
    assert last_state is None and h is None
    assert max_rel_err(o[0, :n], ref_o) < OUT_TOL
    assert torch.equal(o[0, n:], torch.zeros_like(o[0, n:]))  # padding tokens
    assert max_rel_err(pool[slots], ref_final) < STATE_TOL[pool_dtype]
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(pool[others], before[others])


def test_extend_writes_into_sglangs_output_buffer():
    lens, slots = [70, 5], [2, 4]
    fb, md, backend = extend_batch(lens, slots)
    inputs = extend_inputs(lens)
    pool_a = make_pool(torch.float32)
    pool_b = pool_a.clone()
    buffer = torch.full((1, sum(lens), HV, V), float("nan"), dtype=torch.bfloat16)
    kernel = make_kernel()
    kernel.begin_batch(backend, fb)
    o, _, _ = kernel.extend(
        *inputs,
        ssm_states=pool_a,
        cache_indices=md.mamba_cache_indices,
        query_start_loc=md.query_start_loc,
        output=buffer,
    )
    assert o.data_ptr() == buffer.data_ptr()  # SGLang then skips its copy
    o_ref, _, _ = kernel.extend(
        *inputs, ssm_states=pool_b, cache_indices=md.mamba_cache_indices, query_start_loc=md.query_start_loc
    )
    assert torch.equal(buffer, o_ref) and torch.equal(pool_a, pool_b)


def test_plan_is_built_once_per_batch_and_shared_by_layers(monkeypatch):
    import qla_serving.integrations.sglang.kernel as kmod

    calls = []
    real = kmod.plan_prefill
    monkeypatch.setattr(kmod, "plan_prefill", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    lens, slots = [65, 3], [1, 2]
    kernel = make_kernel()
    fb, md, backend = extend_batch(lens, slots)
    kernel.begin_batch(backend, fb)
    pools = [make_pool(torch.float32) for _ in range(3)]
    for pool in pools:  # three GDN layers of one forward
        kernel.extend(
            *extend_inputs(lens),
            ssm_states=pool,
            cache_indices=md.mamba_cache_indices,
            query_start_loc=md.query_start_loc,
        )
    assert len(calls) == 1
    # SGLang gave CPU lengths: the plan holds them, no device read.
    assert calls[0][0].tolist() == [0, 65, 68]
    # A batch whose CPU lengths SGLang did not provide: built once from query_start_loc, reused.
    calls.clear()
    fb2, md2, backend2 = extend_batch([5, 70], [3, 4])
    fb2.extend_seq_lens_cpu = None
    kernel.begin_batch(backend2, fb2)
    for pool in pools:
        kernel.extend(
            *extend_inputs([5, 70]),
            ssm_states=pool,
            cache_indices=md2.mamba_cache_indices,
            query_start_loc=md2.query_start_loc,
        )
    assert len(calls) == 1 and calls[0][0].tolist() == [0, 5, 75]


def _track_setup(lens, slots):
    fb, md, backend = extend_batch(lens, slots, track=True)
    q, k, v, g, beta = extend_inputs(lens)
    pool = make_pool(torch.float32)
    before = pool.clone()
    _, _, ref_ckpt = extend_oracle(q, k, v, g, beta, before[slots].double(), lens)
    chunk_states = oracle_chunk_states(before[slots].double(), ref_ckpt, lens)
    return fb, md, backend, (q, k, v, g, beta), pool, before, chunk_states


def test_extend_fills_sglang_track_snapshot_for_prefix_cache():
    """SGLang >= 0.5.22: extend(track_state=, track_chunk_idx=) and SGLang's own copy to the cache slot."""
    lens, slots = [70, 1, 130, 64], [5, 0, 8, 3]
    kernel = make_kernel()
    fb, md, backend, inputs, pool, before, chunk_states = _track_setup(lens, slots)
    kernel.begin_batch(backend, fb)
    chunk_idx = torch.tensor([1, -1, 2, 0], dtype=torch.int32)
    track_state = torch.full((len(lens), HV, V, K), float("nan"))
    _, _, h = kernel.extend(
        *inputs,
        ssm_states=pool,
        cache_indices=md.mamba_cache_indices,
        query_start_loc=md.query_start_loc,
        track_state=track_state,
        track_chunk_idx=chunk_idx,
    )
    assert h is None
    for row, c in enumerate(chunk_idx.tolist()):
        if c >= 0:
            assert max_rel_err(track_state[row], chunk_states[row][c]) < STATE_TOL[torch.float32], row
    # SGLang's consumer copies the tracked rows into their cache slots (1, 2, 4 are free slots).
    if "h_track_buf" not in inspect.signature(backend._track_mamba_state_extend).parameters:
        return  # SGLang < 0.5.22 has no snapshot consumer (and never passes track_state)
    tracked_rows = torch.tensor([0, 2, 3])
    md.track_ssm_h_src = torch.tensor([0, 1, 2])  # non-empty: the snapshot path
    md.track_ssm_h_batch_src = tracked_rows
    md.track_ssm_h_dst = torch.tensor([1, 2, 4])
    backend._track_mamba_state_extend(fb, None, pool, md, h_track_buf=track_state)
    for dst, row in zip([1, 2, 4], tracked_rows.tolist()):
        assert max_rel_err(pool[dst], chunk_states[row][chunk_idx[row]]) < STATE_TOL[torch.float32]


@pytest.mark.parametrize("cpu_lengths", [True, False])
def test_extend_returns_chunk_states_h_for_older_sglang(cpu_lengths):
    """SGLang < 0.5.22 reads h[track_ssm_h_src] (global chunk index) when a batch tracks a chunk
    state; also when SGLang gave no CPU lengths (the plan is then built from query_start_loc)."""
    lens, slots = [70, 1, 130, 64], [5, 0, 8, 3]
    kernel = make_kernel()
    fb, md, backend, inputs, pool, before, chunk_states = _track_setup(lens, slots)
    if not cpu_lengths:
        fb.extend_seq_lens_cpu = None
    kernel.begin_batch(backend, fb)
    _, _, h = kernel.extend(
        *inputs, ssm_states=pool, cache_indices=md.mamba_cache_indices, query_start_loc=md.query_start_loc
    )
    chunks = [(L + 63) // 64 for L in lens]
    assert h.shape == (1, sum(chunks), HV, V, K) and h.dtype == pool.dtype
    flat = [s for i, n in enumerate(chunks) for s in chunk_states[i][:n]]
    for c, expected in enumerate(flat):
        assert max_rel_err(h[0, c], expected) < STATE_TOL[torch.float32], c
    # SGLang's consumer: seq 0 tracks its chunk 1 (global 1), seq 2 its chunk 2 (global 2 + 1 + 2).
    md.track_ssm_h_src = torch.tensor([1, 5])
    md.track_ssm_h_dst = torch.tensor([1, 6])
    backend._track_mamba_state_extend(fb, h, pool, md)
    assert max_rel_err(pool[1], chunk_states[0][1]) < STATE_TOL[torch.float32]
    assert max_rel_err(pool[6], chunk_states[2][2]) < STATE_TOL[torch.float32]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_oracle(pool_dtype):
    slots = torch.tensor([4, 0, -1, 7, 2], dtype=torch.int32)  # -1: a padded row
    B = slots.numel()
    q, k, v = split_qkv(B)
    a, b = torch.randn(B, HV, dtype=torch.bfloat16), torch.randn(B, HV, dtype=torch.bfloat16)
    A_log, dt_bias = gate_params()
    pool = make_pool(pool_dtype)
    before = pool.clone()
    o = make_kernel().decode(
        q,
        k,
        v,
        a,
        b,
        A_log=A_log,
        dt_bias=dt_bias,
        ssm_states=pool,
        cache_indices=slots,
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
    )
    live = slots >= 0
    init = before[slots.clamp(min=0).long()].double()
    ref_o, ref_states = recurrent_decode_ref(
        q[0].unsqueeze(1),
        k[0].unsqueeze(1),
        v[0].unsqueeze(1),
        a.unsqueeze(1),
        b.unsqueeze(1),
        A_log,
        dt_bias,
        init,
        scale=K**-0.5,
    )
    assert o.shape == (1, B, HV, V) and o.dtype == q.dtype
    assert max_rel_err(o[0, live], ref_o[live, 0]) < OUT_TOL
    assert torch.equal(o[0, ~live], torch.zeros_like(o[0, ~live]))
    live_slots = slots[live].long()
    assert max_rel_err(pool[live_slots], ref_states[live, 0]) < STATE_TOL[pool_dtype]
    others = [s for s in range(NUM_SLOTS) if s not in live_slots.tolist()]
    assert torch.equal(pool[others], before[others])


def verify_inputs(N, T):
    q, k, v = split_qkv(N * T)
    a, b = torch.randn(N * T, HV, dtype=torch.bfloat16), torch.randn(N * T, HV, dtype=torch.bfloat16)
    A_log, dt_bias = gate_params()
    return q, k, v, a, b, A_log, dt_bias


@pytest.mark.parametrize("stable_rows", [False, True])
def test_target_verify_matches_oracle_and_keeps_pool(stable_rows):
    N, T = 3, 4
    slots = torch.tensor([6, 1, 3], dtype=torch.int32)
    rows = torch.tensor([5, 2, 7] if stable_rows else [0, 1, 2], dtype=torch.int32)
    q, k, v, a, b, A_log, dt_bias = verify_inputs(N, T)
    pool = make_pool(torch.float32)
    before = pool.clone()
    buffer = torch.zeros(NUM_SLOTS + 1, T, HV, V, K)
    o = make_kernel().target_verify(
        A_log,
        dt_bias,
        q,
        k,
        v,
        a,
        b,
        ssm_states=pool,
        cache_indices=slots,
        query_start_loc=torch.arange(0, N * T + 1, T, dtype=torch.int32),
        intermediate_states_buffer=buffer,
        intermediate_state_indices=rows,
        cache_steps=T,
        retrieve_parent_token=None,
        stable_rows=stable_rows,
    )
    ref_o, ref_states = verify_ref(q, k, v, a, b, A_log, dt_bias, before[slots.long()].double(), N, T)
    assert o.shape == v.shape and o.dtype == q.dtype
    assert max_rel_err(o.view(N, T, HV, V), ref_o) < OUT_TOL
    assert max_rel_err(buffer[rows.long()], ref_states) < STATE_TOL[torch.float32]
    assert torch.equal(pool, before)  # verify never writes the pool; SGLang commits the accepted prefix
    untouched = [r for r in range(NUM_SLOTS + 1) if r not in rows.tolist()]
    assert torch.equal(buffer[untouched], torch.zeros_like(buffer[untouched]))


class RecordingKernel:
    """Stands in for the fallback kernel (the dispatcher's triton kernel, which needs a GPU)."""

    def __init__(self):
        self.calls = []

    def target_verify(self, **kwargs):
        self.calls.append(kwargs)
        return torch.zeros_like(kwargs["v"])


@pytest.mark.parametrize("case", ["tree", "ragged", "too_many_tokens"])
def test_target_verify_hands_unsupported_drafts_to_fallback(case):
    from qla_serving.integrations.sglang.kernel import FlashQLAGDNKernel

    fallback = RecordingKernel()
    kernel = FlashQLAGDNKernel(fallback=fallback, phases={"verify"})
    N, T = 2, MAX_DECODE_TOKENS + 1 if case == "too_many_tokens" else 3
    q, k, v, a, b, A_log, dt_bias = verify_inputs(N, T)
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    if case == "ragged":
        qsl = torch.tensor([0, 2, N * T], dtype=torch.int32)
        q, k, v, a, b = (x[:, : N * T - 1] if x.dim() == 4 else x[: N * T - 1] for x in (q, k, v, a, b))
    parent = torch.zeros(N, T, dtype=torch.long) if case == "tree" else None
    pool = make_pool(torch.float32)
    before = pool.clone()
    kernel.target_verify(
        A_log,
        dt_bias,
        q,
        k,
        v,
        a,
        b,
        ssm_states=pool,
        cache_indices=torch.tensor([1, 2]),
        query_start_loc=qsl,
        intermediate_states_buffer=torch.zeros(4, T, HV, V, K),
        intermediate_state_indices=torch.arange(4),
        cache_steps=T,
        retrieve_parent_token=parent,
    )
    assert len(fallback.calls) == 1 and fallback.calls[0]["retrieve_parent_token"] is parent
    assert torch.equal(pool, before)


def test_sglang_dispatcher_routes_calls_to_our_kernel(publish_args, build_dispatcher):
    """The real GDNKernelDispatcher (flashqla flags) sends extend/decode/verify to our kernel."""
    _, d = build_dispatcher(publish_args("--linear-attn-backend", "flashqla"))
    lens, slots = [66, 9], [2, 6]
    fb, md, backend = extend_batch(lens, slots)
    d.extend_kernel.begin_batch(backend, fb)
    inputs = extend_inputs(lens)
    pool_a, pool_b = make_pool(torch.float32), None
    pool_b = pool_a.clone()
    o_disp, _, _ = d.extend(
        *inputs, ssm_states=pool_a, cache_indices=md.mamba_cache_indices, query_start_loc=md.query_start_loc
    )
    o_direct, _, _ = make_kernel().extend(
        *inputs, ssm_states=pool_b, cache_indices=md.mamba_cache_indices, query_start_loc=md.query_start_loc
    )
    assert torch.equal(o_disp, o_direct) and torch.equal(pool_a, pool_b)
    N, T = 2, 2
    q, k, v, a, b, A_log, dt_bias = verify_inputs(N, T)
    buffer = torch.zeros(NUM_SLOTS + 1, T, HV, V, K)
    before = pool_a.clone()
    o = d.target_verify(
        A_log=A_log,
        dt_bias=dt_bias,
        q=q,
        k=k,
        v=v,
        a=a,
        b=b,
        ssm_states=pool_a,
        cache_indices=torch.tensor([2, 6], dtype=torch.int32),
        query_start_loc=torch.arange(0, N * T + 1, T, dtype=torch.int32),
        intermediate_states_buffer=buffer,
        intermediate_state_indices=torch.arange(NUM_SLOTS + 1),
        cache_steps=T,
        retrieve_parent_token=None,
    )
    assert o.shape == v.shape and torch.equal(pool_a, before) and buffer[:N].abs().sum() > 0


def test_chunk_start_rows_point_at_each_chunks_entering_state():
    """Row i: sequence i's initial state; then its checkpoints after every 64 tokens, in order."""
    from qla_serving.integrations.sglang.kernel import FlashQLAGDNKernel

    from qla_serving.plan import plan_prefill

    lengths = [130, 64, 1, 200]
    plan = plan_prefill(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), checkpoint_every=64)
    expected, ckpt_row = [], len(lengths)
    for i, L in enumerate(lengths):
        chunks = (L + 63) // 64
        expected += [i] + [ckpt_row + c for c in range(chunks - 1)]
        ckpt_row += L // 64
    assert FlashQLAGDNKernel._chunk_start_rows(plan).tolist() == expected


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_inference_plans_autocp_per_sequence(publish_args, build_dispatcher, monkeypatch,
                                                           deterministic):
    """``--enable-deterministic-inference`` read from SGLang's own published config: every plan
    of our kernel object (the batch's, and its rebuild with the prefix cache's checkpoints) asks
    the planner for AutoCP per sequence, and the start-up line says so; without the flag the
    environment (``QLA_CP_PER_SEQUENCE``) decides."""
    import logging

    import qla_serving.integrations.sglang.kernel as kmod

    monkeypatch.delenv("QLA_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", raising=False)
    flags = ("--linear-attn-backend", "flashqla") + (
        ("--enable-deterministic-inference", "--attention-backend", "triton") if deterministic else ())
    args = publish_args(*flags)  # (SGLang's parser configures logging anew: the handler goes on after it)
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    ours = logging.getLogger("qla_serving")
    ours.addHandler(handler)
    level = ours.level
    ours.setLevel(logging.INFO)
    try:
        _, d = build_dispatcher(args)
    finally:
        ours.removeHandler(handler)
        ours.setLevel(level)
    assert kmod.engine_deterministic() is deterministic
    kernel = d.extend_kernel
    assert isinstance(kernel, kmod.FlashQLAGDNKernel)
    assert kernel.cp_per_sequence is (True if deterministic else None)
    said = any("(--enable-deterministic-inference): batch-invariant bits" in line for line in lines)
    assert said is deterministic and any("uses FlashQLAGDNKernel" in line for line in lines)
    asked = []
    real = kmod.plan_prefill
    monkeypatch.setattr(kmod, "plan_prefill", lambda *a, **kw: asked.append(kw["cp_per_sequence"]) or real(*a, **kw))
    fb, md, backend = extend_batch([65, 3], [1, 2])
    kernel.begin_batch(backend, fb)
    kernel._plan_for(md.query_start_loc, 64)  # a rebuild with checkpoints keeps the choice
    assert asked == [kernel.cp_per_sequence] * 2


def test_deterministic_inference_read_from_the_environment_without_a_published_config(monkeypatch):
    """Where SGLang publishes no config (older versions, tools), the variable SGLang sets for its
    processes decides."""
    import qla_serving.integrations.sglang.kernel as kmod
    from sglang.srt import runtime_context

    monkeypatch.setattr(runtime_context, "get_exec", lambda: (_ for _ in ()).throw(RuntimeError("not published")))
    monkeypatch.setenv("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "1")
    assert kmod.engine_deterministic() is True
    assert make_kernel().cp_per_sequence is True
    monkeypatch.setenv("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", "0")
    assert kmod.engine_deterministic() is False
    assert make_kernel().cp_per_sequence is None
