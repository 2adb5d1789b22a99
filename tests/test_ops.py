"""The public ops on the CPU (reference path) against the float64 oracle."""

import logging

import pytest
import torch

import qla_serving
from qla_serving import backend
from qla_serving.kernels import decode as decode_host
from qla_serving.ops.gated_delta_rule.naive import recurrent_decode_ref, recurrent_gated_delta_rule_ref

from helpers import cu_of, make_gates, make_qkv, rel_err

TOL = 2e-5  # float32 reference path vs float64 oracle


def _batch(lengths, H=2, HV=4, K=16, V=16, mode="qwen"):
    T = sum(lengths)
    q, k, v = make_qkv(T, H, HV, K, V, dtype=torch.float32)
    g, beta = make_gates(T, HV, mode, dtype=torch.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("state_v_first", [False, True], ids=["fla-layout", "engine-layout"])
@pytest.mark.parametrize("varlen", [False, True])
def test_fla_api_matches_oracle(state_v_first, varlen):
    B, T, H, HV, K = (1, 150, 2, 6, 16) if varlen else (3, 70, 2, 6, 16)
    q, k, v, g, beta = _batch([B * T], H, HV, K, K)
    q4, k4, v4 = (x.view(B, T, *x.shape[1:]) for x in (q, k, v))
    g3, b3 = g.view(B, T, HV), beta.view(B, T, HV)
    lengths = [1, 64, 85] if varlen else [T] * B
    cu = cu_of(lengths)
    N = len(lengths)
    h0_engine = torch.randn(N, HV, K, K)
    h0 = h0_engine if state_v_first else h0_engine.transpose(-1, -2).contiguous()
    h0_before = h0.clone()
    o, final = qla_serving.chunk_gated_delta_rule(
        q4, k4, v4, g3, b3, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu if varlen else None, state_v_first=state_v_first)
    assert torch.equal(h0, h0_before)  # the caller's state is read, never written
    o_r, s_r, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0_engine, cu_seqlens=cu,
                                                 use_qk_l2norm=True)
    assert o.shape == (B, T, HV, K) and o.dtype == q.dtype
    assert final.dtype == torch.float32
    assert rel_err(o.reshape(-1, HV, K), o_r) <= TOL
    assert rel_err(final if state_v_first else final.transpose(-1, -2), s_r) <= TOL


def test_fla_api_without_state():
    q, k, v, g, beta = _batch([40])
    o, final = qla_serving.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None])
    o_r, _, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta)
    assert final is None and rel_err(o[0], o_r) <= TOL


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batched", [False, True], ids=["[T,..]", "[1,T,..]"])
def test_pool_prefill_scattered_slots(pool_dtype, batched):
    lengths = [65, 1, 128, 30]
    HV, K = 4, 16
    q, k, v, g, beta = _batch(lengths, 2, HV, K, K)
    # A pool with a slot stride larger than a slot (engines share the buffer with conv state).
    backing = torch.randn(12, HV * K * K + 40).to(pool_dtype)
    pool = backing[:, :HV * K * K].view(12, HV, K, K)
    before = backing.clone()
    slots = torch.tensor([9, 2, 7, 4], dtype=torch.int32)  # out of order, scattered
    has_init = torch.tensor([True, False, True, True])
    init = torch.where(has_init.view(-1, 1, 1, 1), pool[slots.long()].double(), 0.0)
    args = (q, k, v, g, beta) if not batched else tuple(x[None] for x in (q, k, v, g, beta))
    o = qla_serving.chunk_gated_delta_rule_pool(*args, pool, slots, cu_seqlens=cu_of(lengths),
                                                has_initial_state=has_init, use_qk_l2norm_in_kernel=True)
    o_r, s_r, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lengths),
                                                 use_qk_l2norm=True)
    assert o.shape == ((1,) if batched else ()) + (sum(lengths), HV, K)
    assert rel_err(o.reshape(o_r.shape), o_r) <= TOL
    tol = TOL if pool_dtype == torch.float32 else 1e-2
    assert rel_err(pool[slots.long()], s_r) <= tol
    touched = torch.zeros(12, dtype=torch.bool)
    touched[slots.long()] = True
    assert torch.equal(backing[~touched], before[~touched])
    assert torch.equal(backing[:, HV * K * K:], before[:, HV * K * K:])  # the bytes between slots


def test_plan_reused_across_layers_and_checkpoints():
    lengths = [200, 64, 3, 130]
    HV, K = 4, 16
    plan = qla_serving.plan_prefill(cu_of(lengths), checkpoint_every=64)
    assert plan.num_checkpoints == 3 + 1 + 0 + 2
    slots = torch.tensor([3, 0, 1, 2], dtype=torch.int32)
    for layer in range(2):  # two layers, one plan
        q, k, v, g, beta = _batch(lengths, 2, HV, K, K)
        pool = torch.randn(4, HV, K, K)
        init = pool[slots.long()].clone()
        ckpts = torch.full((plan.num_checkpoints, HV, K, K), float("nan"))
        out = torch.full((sum(lengths), HV, K), float("nan"))
        o = qla_serving.chunk_gated_delta_rule_pool(q, k, v, g, beta, pool, slots, plan=plan,
                                                    checkpoints=ckpts, out=out, use_qk_l2norm_in_kernel=True)
        assert o.data_ptr() == out.data_ptr()
        o_r, s_r, c_r = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init,
                                                       cu_seqlens=plan.cu_seqlens_cpu, use_qk_l2norm=True,
                                                       checkpoint_every=64)
        assert not torch.isnan(out).any() and not torch.isnan(ckpts).any()
        assert rel_err(out, o_r) <= TOL and rel_err(ckpts, c_r) <= TOL and rel_err(pool[slots.long()], s_r) <= TOL


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_oracle(T, pool_dtype):
    N, H, HV, K = 5, 2, 4, 16
    q, k = torch.randn(N, T, H, K), torch.randn(N, T, H, K)
    v = torch.randn(N, T, HV, K)
    a, b = torch.randn(N, T, HV), torch.randn(N, T, HV)
    A_log, dt_bias = torch.empty(HV).uniform_(-4, 1.5), torch.randn(HV)
    pool = torch.randn(9, HV, K, K).to(pool_dtype)
    before = pool.clone()
    idx = torch.tensor([6, -1, 0, 8, 3], dtype=torch.int32)
    live = idx >= 0
    inter = torch.full((N, T, HV, K, K), float("nan")).to(pool_dtype)
    o = qla_serving.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx, intermediate_states=inter)
    init = torch.where(live.view(-1, 1, 1, 1), before[idx.long().clamp(min=0)].double(), 0.0)
    o_r, s_r = recurrent_decode_ref(q, k, v, a, b, A_log, dt_bias, init)
    tol = TOL if pool_dtype == torch.float32 else 1e-2
    assert rel_err(o[live], o_r[live]) <= tol
    assert torch.equal(o[~live], torch.zeros_like(o[~live]))  # padded row: zeros
    assert rel_err(inter[live], s_r[live]) <= tol
    assert torch.isnan(inter[~live].float()).all()  # padded row: not written
    assert rel_err(pool[idx[live].long()], s_r[live, -1]) <= tol
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[idx[live].long()] = False
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("T", [1, 3])
def test_decode_reads_packed_views_with_null_slot(T):
    """q, k, v as column ranges of one packed [tokens, (2H + HV) K] buffer and a, b as columns of a
    packed gate projection (the engines' conv output and in_proj_ba), with vLLM's null slot 0 as
    padding (min_slot=1): the same result as contiguous inputs with -1 padding."""
    N, H, HV, K = 4, 2, 4, 16
    D = (2 * H + HV) * K
    packed = torch.randn(N * T, D + HV * K)  # extra columns: the z part of vLLM's qkvz split
    ab = torch.randn(N * T, 2 * HV)
    q, k, v = (packed[:, :H * K].view(N, T, H, K), packed[:, H * K:2 * H * K].view(N, T, H, K),
               packed[:, 2 * H * K:D].view(N, T, HV, K))
    b, a = (x.reshape(N, T, HV) for x in ab.chunk(2, dim=-1))
    assert not q.is_contiguous() and not a.is_contiguous()
    assert decode_host.token_stride(q, (H, K), H * K) == D + HV * K  # read in place, a packed row apart
    A_log, dt_bias = torch.empty(HV).uniform_(-4, 1.5), torch.randn(HV)
    pool = torch.randn(6, HV, K, K)
    before = pool.clone()
    null_padded = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    o = qla_serving.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, null_padded, min_slot=1)
    ref_pool = before.clone()
    o_c = qla_serving.gated_delta_rule_decode(q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(),
                                              b.contiguous(), A_log, dt_bias, ref_pool,
                                              torch.tensor([3, -1, 5, 1], dtype=torch.int32))
    # (the CPU reference's float32 matmuls may round differently on strided operands)
    assert rel_err(o, o_c) <= 1e-6 and rel_err(pool, ref_pool) <= 1e-6
    assert torch.equal(pool[0], before[0])  # the null slot is padding: never read into a row, never written
    live = torch.tensor([True, False, True, True])
    _, s_r = recurrent_decode_ref(q, k, v, a, b, A_log, dt_bias, before[[3, 0, 5, 1]].double())
    assert rel_err(pool[[3, 5, 1]], s_r[live, -1]) <= TOL


def test_decode_copies_inputs_it_cannot_read_in_place():
    N, H, HV, K = 3, 2, 2, 16
    q, k = torch.randn(N, 1, K, H).transpose(-1, -2), torch.randn(N, 1, H, K)  # q: K-major heads
    v, a, b = torch.randn(N, 1, HV, K), torch.randn(N, 1, HV), torch.randn(N, 1, HV)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV)
    assert decode_host.token_stride(q, (H, K), H * K) is None  # copied first
    pool = torch.randn(4, HV, K, K)
    pool2 = pool.clone()
    o = qla_serving.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([2, 0, 1]))
    o_c = qla_serving.gated_delta_rule_decode(q.contiguous(), k, v, a, b, A_log, dt_bias, pool2,
                                              torch.tensor([2, 0, 1]))
    assert torch.equal(o, o_c) and torch.equal(pool, pool2)


def test_decode_single_token_shape_and_no_inplace():
    N, H, HV, K = 3, 1, 2, 16
    q, k, v = torch.randn(N, H, K), torch.randn(N, H, K), torch.randn(N, HV, K)
    a, b = torch.randn(N, HV), torch.randn(N, HV)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV)
    pool = torch.randn(4, HV, K, K)
    before = pool.clone()
    inter = torch.empty(N, 1, HV, K, K)
    o = qla_serving.gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([2, 0, 1]),
                                            intermediate_states=inter, inplace_final_state=False)
    assert o.shape == (N, HV, K)
    assert torch.equal(pool, before)  # verify mode: the engine keeps the accepted prefix itself
    _, s_r = recurrent_decode_ref(q[:, None], k[:, None], v[:, None], a[:, None], b[:, None], A_log, dt_bias,
                                  before[[2, 0, 1]])
    assert rel_err(inter, s_r) <= TOL


def test_fallback_logs_once_and_strict_raises(monkeypatch, caplog):
    backend._warned.clear()
    q, k, v, g, beta = _batch([10])
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        for _ in range(3):
            qla_serving.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None])
    msgs = [r.getMessage() for r in caplog.records if "reference" in r.getMessage()]
    # the model's limit is named first (it holds on every machine), the device after it
    assert len(msgs) == 1 and "K = V = 128" in msgs[0]
    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(backend.KernelUnavailable, match="QLA_STRICT"):
        qla_serving.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None])


def test_unsupported_reasons_name_the_constraint():
    assert "K = V = 128" in backend.config_unsupported_reason(64, 128, torch.bfloat16)
    assert "K = V = 128" in backend.config_unsupported_reason(128, 256, torch.bfloat16)
    assert "float32" in backend.config_unsupported_reason(128, 128, torch.float32)
    assert backend.config_unsupported_reason(128, 128, torch.bfloat16) is None
    assert "float16" in backend.config_unsupported_reason(128, 128, torch.bfloat16, torch.float16)
    assert backend.config_unsupported_reason(128, 128, torch.bfloat16, torch.bfloat16) is None
    assert "cpu" in backend.unsupported_reason(torch.device("cpu"), 128, 128, torch.bfloat16)
    assert "K = V = 128" in backend.unsupported_reason(torch.device("cpu"), 64, 128, torch.bfloat16)


def test_strict_mode_names_head_dim_on_a_supported_device(monkeypatch):
    """On a GPU that could run the kernels, K != 128 falls back, or raises under QLA_STRICT=1."""
    monkeypatch.setattr(backend, "device_unsupported_reason", lambda device: None)
    monkeypatch.setenv("QLA_STRICT", "1")
    q, k, v, g, beta = _batch([10], K=64, V=64)
    with pytest.raises(backend.KernelUnavailable, match=r"K=64, V=64; the kernels need K = V = 128"):
        qla_serving.chunk_gated_delta_rule(q[None].bfloat16(), k[None].bfloat16(), v[None].bfloat16(),
                                           g[None], beta[None])
    N, HV = 2, 4
    with pytest.raises(backend.KernelUnavailable, match="K = V = 128"):
        qla_serving.gated_delta_rule_decode(
            torch.randn(N, 2, 64).bfloat16(), torch.randn(N, 2, 64).bfloat16(), torch.randn(N, HV, 64).bfloat16(),
            torch.randn(N, HV), torch.randn(N, HV), torch.zeros(HV), torch.zeros(HV), torch.zeros(3, HV, 64, 64),
            torch.tensor([0, 2]))


def test_kernel_entry_resolves_the_kernel_functions(monkeypatch):
    """With a supported device the ops get the kernels' real entry points (modules import without TileLang)."""
    from qla_serving.kernels import chunk_prefill, decode

    monkeypatch.setattr(backend, "device_unsupported_reason", lambda device: None)
    dev = torch.device("cpu")
    from qla_serving.ops.gated_delta_rule import chunk as chunk_op
    from qla_serving.ops.gated_delta_rule import decode as decode_op

    assert backend.kernel_entry("prefill", chunk_op._prefill_kernels, dev, 128, 128,
                                torch.bfloat16) is chunk_prefill.chunk_gated_delta_rule_fwd
    assert backend.kernel_entry("decode", decode_op._decode_kernel, dev, 128, 128,
                                torch.float16) is decode.gated_delta_rule_decode_fwd

    def broken():
        import qla_serving.kernels.no_such_module  # noqa: F401

    backend._warned.clear()
    assert backend.kernel_entry("decode", broken, dev, 128, 128, torch.bfloat16) is None
    assert any("no_such_module" in r for _, r in backend._warned)
    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(backend.KernelUnavailable, match="kernel module does not import.*no_such_module"):
        backend.kernel_entry("decode", broken, dev, 128, 128, torch.bfloat16)


def test_tilelang_version_mismatch_is_a_fallback_reason(monkeypatch):
    """The engines pin older TileLangs than the kernels are built for: that must be a named reason."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "tilelang" else None)
    from qla_serving.kernels import library

    monkeypatch.setattr(library, "_installed_tilelang", lambda: "0.1.12")
    reason = backend.tilelang_unsupported_reason()
    assert "TileLang 0.1.12 is installed" in reason and backend.TILELANG_VERSION in reason
    monkeypatch.setattr(library, "_installed_tilelang", lambda: backend.TILELANG_VERSION + "+cu130")
    assert backend.tilelang_unsupported_reason() is None
    monkeypatch.setattr(library, "_installed_tilelang", lambda: "0.1.9")
    monkeypatch.setenv("QLA_ALLOW_TILELANG", "1")
    assert backend.tilelang_unsupported_reason() is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "not installed" in backend.tilelang_unsupported_reason()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_entry_with_only_empty_sequences(pool_dtype):
    """No tokens at all: slots without an initial state are zeroed, the others keep theirs (no kernel runs)."""
    from qla_serving.kernels.chunk_prefill import chunk_gated_delta_rule_fwd

    HV = 4
    pool = torch.randn(5, HV, 128, 128).to(pool_dtype)
    before = pool.clone()
    plan = qla_serving.plan_prefill([0, 0, 0])
    chunk_gated_delta_rule_fwd(
        torch.empty(0, 2, 128, dtype=torch.bfloat16), torch.empty(0, 2, 128, dtype=torch.bfloat16),
        torch.empty(0, HV, 128, dtype=torch.bfloat16), torch.empty(0, HV), torch.empty(0, HV), scale=0.1, plan=plan,
        state_pool=pool, state_indices=torch.tensor([3, 1], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]), use_qk_l2norm=True,
        out=torch.empty(0, HV, 128, dtype=torch.bfloat16))
    assert torch.equal(pool[3], before[3]) and not pool[1].any()
    assert torch.equal(pool[[0, 2, 4]], before[[0, 2, 4]])
    # The reference path agrees.
    pool_ref = before.clone()
    qla_serving.chunk_gated_delta_rule_pool(
        torch.empty(0, 2, 128), torch.empty(0, 2, 128), torch.empty(0, HV, 128), torch.empty(0, HV),
        torch.empty(0, HV), pool_ref, torch.tensor([3, 1], dtype=torch.int32), plan=plan,
        has_initial_state=torch.tensor([True, False]))
    assert torch.equal(pool_ref, pool)


def test_token_stride_is_what_the_decode_kernel_reads_in_place():
    """The rule the op copies by and the kernel's launch reads by (one function): the token stride
    of a contiguous tensor, of a packed buffer's column range, of one sequence of T tokens; None
    for a layout the kernel cannot read."""
    N, T, H, K, HV = 3, 2, 2, 16, 4
    token_stride = decode_host.token_stride
    assert token_stride(torch.empty(N, 1, H, K), (H, K), H * K) == H * K
    assert token_stride(torch.empty(N, T, H, K), (H, K), H * K) == H * K
    assert token_stride(torch.empty(1, 1, H, K), (H, K), H * K) == 0  # a single token: no stride
    packed = torch.empty(N * T, 5 * H * K)
    q = packed[:, H * K:2 * H * K].view(N, T, H, K)
    assert token_stride(q, (H, K), H * K) == 5 * H * K
    odd = torch.empty(N * T, 2 * H * K + 8)[:, :H * K].view(N * T, 1, H, K)  # rows 72 elements apart
    assert token_stride(odd, (H, K), H * K) is None and token_stride(odd, (H, K)) == 2 * H * K + 8
    assert token_stride(torch.empty(N, 1, K, H).transpose(-1, -2), (H, K), H * K) is None  # K-major heads
    ab = torch.empty(N * T, 2 * HV)
    assert token_stride(ab[:, HV:].view(N, T, HV), (HV,)) == 2 * HV
    assert token_stride(torch.empty(T, N, HV).transpose(0, 1), (HV,)) is None  # tokens not one stride apart


@pytest.mark.parametrize("wide_rows", [False, True], ids=["conv-output", "wider-rows"])
def test_pool_prefill_packed_inputs_match_oracle(wide_rows):
    """The packed form takes the engine's conv output ``[T, (2H + HV) K]`` and its raw gate inputs
    (a and b the two halves of one projection): against the float64 oracle on the same values,
    and the same result as the classic form given them split and gated (its CPU path is that)."""
    from qla_serving.ops.gated_delta_rule.naive import gdn_gate_ref

    lengths = [65, 1, 130]
    H, HV, K = 2, 4, 128
    T, D = sum(lengths), (2 * H + HV) * K
    backing = torch.randn(T, D + (HV * K if wide_rows else 0))  # wider: a z part after v, as vLLM's qkvz
    qkv = backing[:, :D]
    ab = torch.randn(T, 2 * HV)
    a, b = ab[:, :HV], ab[:, HV:]
    A_log, dt_bias = torch.empty(HV).uniform_(0.0, 1.5), torch.empty(HV).uniform_(-3.0, 0.0)
    pool = torch.randn(7, HV, K, K)
    before = pool.clone()
    slots = torch.tensor([5, 0, 3], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    o = qla_serving.chunk_gated_delta_rule_pool_packed(qkv, a, b, A_log, dt_bias, pool, slots, num_qk_heads=H,
                                                       cu_seqlens=cu_of(lengths), has_initial_state=has_init)
    q, k, v = (x.reshape(T, -1, K) for x in qkv.split([H * K, H * K, HV * K], dim=-1))
    g64, beta64 = gdn_gate_ref(a, b, A_log, dt_bias)
    init = torch.where(has_init.view(-1, 1, 1, 1), before[slots.long()].double(), 0.0)
    o_r, s_r, _ = recurrent_gated_delta_rule_ref(q, k, v, g64, beta64, initial_state=init, cu_seqlens=cu_of(lengths),
                                                 use_qk_l2norm=True)
    assert o.shape == (T, HV, K) and rel_err(o, o_r) <= TOL and rel_err(pool[slots.long()], s_r) <= TOL
    untouched = torch.ones(7, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(pool[untouched], before[untouched])
    classic_pool = before.clone()
    g, beta = gdn_gate_ref(a, b, A_log, dt_bias, dtype=torch.float32)
    o_c = qla_serving.chunk_gated_delta_rule_pool(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, classic_pool,
                                                  slots, cu_seqlens=cu_of(lengths), has_initial_state=has_init,
                                                  use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, o_c) and torch.equal(pool, classic_pool)


def test_pool_prefill_packed_inputs_name_the_constraint():
    H, HV, K, T = 2, 4, 128, 5
    qkv = torch.randn(T, (2 * H + HV) * K, dtype=torch.bfloat16)
    a = b = torch.randn(T, HV, dtype=torch.bfloat16)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV)
    pool, slots = torch.zeros(2, HV, K, K), torch.tensor([1], dtype=torch.int32)
    call = dict(num_qk_heads=H, cu_seqlens=cu_of([T]))
    with pytest.raises(ValueError, match=r"\(2 \* 2 \+ 4\) \* 128 = 1024"):
        qla_serving.chunk_gated_delta_rule_pool_packed(qkv[:, :-128], a, b, A_log, dt_bias, pool, slots, **call)
    with pytest.raises(TypeError, match="a has dtype torch.float32; it must match qkv's torch.bfloat16"):
        qla_serving.chunk_gated_delta_rule_pool_packed(qkv, a.float(), b, A_log, dt_bias, pool, slots, **call)
    with pytest.raises(ValueError, match="b"):
        qla_serving.chunk_gated_delta_rule_pool_packed(qkv, a, b[:, :2], A_log, dt_bias, pool, slots, **call)
    with pytest.raises(ValueError, match="multiple"):
        qla_serving.chunk_gated_delta_rule_pool_packed(qkv[:, :(6 + 4) * K], a, b, A_log, dt_bias, pool, slots,
                                                       num_qk_heads=3, cu_seqlens=cu_of([T]))
