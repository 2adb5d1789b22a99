"""GPU tests of the TileLang chunked prefill (qla_serving.kernels.chunk_prefill).

Every test draws fresh random inputs (seed printed by conftest on failure) and compares with
the float64 token-by-token oracle (`recurrent_gated_delta_rule_ref`); the stage test compares
the kernels' workspaces with the float32 chunked reference's intermediates.
"""

import random

import pytest
import torch
from helpers import rel_err

from qla_serving.ops.gated_delta_rule.naive import (
    chunk_gated_delta_rule_ref,
    gdn_gate_ref,
    l2norm,
    recurrent_gated_delta_rule_ref,
)
from qla_serving.plan import plan_prefill

K = V = 128
TOL = 1e-2  # norm-wise relative error vs the float64 oracle


def _make_case(lens, H, HV, *, dtype=torch.bfloat16, beta_dtype=torch.float32, pool_dtype=torch.float32,
               l2=True, init_frac=0.5, slot_pad=0, extra_slots=3, checkpoint_every=None):
    """Random inputs, a pool with extra (untouched) slots and the plan of one batch."""
    dev = "cuda"
    T = sum(lens)
    N = len(lens)
    q = torch.randn(T, H, K, device=dev)
    k = torch.randn(T, H, K, device=dev)
    if not l2:  # without the in-kernel norm the caller passes unit-norm q, k (as models do)
        q, k = l2norm(q), l2norm(k)
    v = torch.randn(T, HV, V, device=dev)
    # Qwen-style gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    a, b = torch.randn(T, HV, device=dev), torch.randn(T, HV, device=dev)
    A_log = torch.empty(HV, device=dev).uniform_(0.0, 1.5)
    dt_bias = torch.empty(HV, device=dev).uniform_(-3.0, 0.0)
    g, beta = gdn_gate_ref(a, b, A_log, dt_bias, dtype=torch.float32)
    num_slots = N + extra_slots
    slot_elems = HV * V * K
    buf = torch.randn(num_slots, slot_elems + slot_pad, device=dev).to(pool_dtype)
    pool = buf[:, :slot_elems].view(num_slots, HV, V, K)  # slot stride > HV*V*K when slot_pad > 0
    state_indices = torch.randperm(num_slots, device=dev)[:N].to(torch.int32)
    has_init = torch.rand(N, device=dev) < init_frac
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int64)
    plan = plan_prefill(cu, device=dev, checkpoint_every=checkpoint_every)
    return dict(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g.contiguous(), beta=beta.to(beta_dtype).contiguous(),
        pool=pool, buf=buf, state_indices=state_indices, has_init=has_init, plan=plan, cu=cu, l2=l2,
    )


def _run(case, out=None, checkpoints=None, scale=K**-0.5):
    from qla_serving.kernels.chunk_prefill import chunk_gated_delta_rule_fwd

    if out is None:
        out = torch.full_like(case["v"], float("nan"))  # poisoned: every element must be written
    chunk_gated_delta_rule_fwd(
        case["q"], case["k"], case["v"], case["g"], case["beta"], scale=scale, plan=case["plan"],
        state_pool=case["pool"], state_indices=case["state_indices"], has_initial_state=case["has_init"],
        use_qk_l2norm=case["l2"], checkpoints=checkpoints, out=out,
    )
    return out


def _oracle(case, pool_before, checkpoint_every=None, scale=K**-0.5):
    idx = case["state_indices"].long()
    h0 = pool_before[idx].double() * case["has_init"].double()[:, None, None, None]
    return recurrent_gated_delta_rule_ref(
        case["q"], case["k"], case["v"], case["g"], case["beta"], scale=scale, initial_state=h0,
        cu_seqlens=case["cu"], use_qk_l2norm=case["l2"], checkpoint_every=checkpoint_every,
    )


def _check_against_oracle(case, out, pool_before, ckpt=None, checkpoint_every=None):
    o_ref, final_ref, ckpt_ref = _oracle(case, pool_before, checkpoint_every)
    assert torch.isfinite(out).all(), "output has NaN/Inf (poisoned rows not written?)"
    assert rel_err(out, o_ref) < TOL, f"o rel err {rel_err(out, o_ref):.3e}"
    idx = case["state_indices"].long()
    final = case["pool"][idx]
    assert torch.isfinite(final).all()
    assert rel_err(final, final_ref) < TOL, f"final state rel err {rel_err(final, final_ref):.3e}"
    untouched = torch.ones(case["pool"].shape[0], dtype=torch.bool, device=out.device)
    untouched[idx] = False
    assert torch.equal(case["pool"][untouched], pool_before[untouched]), "a slot not in state_indices changed"
    if ckpt is not None:
        assert ckpt.shape == ckpt_ref.shape
        assert torch.isfinite(ckpt).all()
        if ckpt_ref.numel():
            assert rel_err(ckpt, ckpt_ref) < TOL, f"checkpoint rel err {rel_err(ckpt, ckpt_ref):.3e}"


VARLEN_MIXES = [
    # 1-token sequences: eight of them, since with one token and 2 q/k heads the output is
    # two q.k products, and the bf16 rounding of the normalised q, k alone can move a small
    # product by more than 1%; more products make the norm-wise error representative
    [1] * 8,
    [63],
    [64],
    [65],
    [1, 63, 64, 65, 130, 1],
    [700, 3, 129],
    [1500],
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens", VARLEN_MIXES, ids=lambda x: "-".join(map(str, x)))
def test_varlen_bf16_gva4_fp32_pool(lens):
    case = _make_case(lens, 2, 8, beta_dtype=torch.bfloat16)
    pool_before = case["pool"].clone()
    out = _run(case)
    _check_against_oracle(case, out, pool_before)


@pytest.mark.gpu
@pytest.mark.parametrize("init_frac", [0.0, 1.0])
def test_with_and_without_initial_state(init_frac):
    case = _make_case([200, 64, 5], 2, 8, beta_dtype=torch.bfloat16, init_frac=init_frac)
    pool_before = case["pool"].clone()
    out = _run(case)
    _check_against_oracle(case, out, pool_before)


@pytest.mark.gpu
def test_bf16_pool_fp32_beta_strided_slots():
    case = _make_case([300, 1, 64, 77], 4, 16, beta_dtype=torch.float32, pool_dtype=torch.bfloat16, slot_pad=1000)
    assert case["pool"].stride(0) > 16 * V * K
    pool_before = case["pool"].clone()
    buf_before = case["buf"].clone()
    out = _run(case)
    _check_against_oracle(case, out, pool_before)
    # the padding between slots (another engine state in vLLM's shared buffer) is untouched
    assert torch.equal(case["buf"][:, 16 * V * K:], buf_before[:, 16 * V * K:])


@pytest.mark.gpu
def test_fp16_no_l2norm_no_gva():
    case = _make_case([129, 64, 2, 250], 16, 16, dtype=torch.float16, beta_dtype=torch.float16, l2=False)
    pool_before = case["pool"].clone()
    out = _run(case)
    _check_against_oracle(case, out, pool_before)


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_checkpoints(pool_dtype):
    every = 128
    beta_dtype = torch.bfloat16 if pool_dtype == torch.float32 else torch.float32
    H, HV = (2, 8) if pool_dtype == torch.float32 else (4, 16)
    case = _make_case([300, 127, 128, 64, 513], H, HV, beta_dtype=beta_dtype, pool_dtype=pool_dtype,
                      checkpoint_every=every)
    plan = case["plan"]
    ckpt = torch.full((plan.num_checkpoints, HV, V, K), float("nan"), dtype=pool_dtype, device="cuda")
    pool_before = case["pool"].clone()
    out = _run(case, checkpoints=ckpt)
    _check_against_oracle(case, out, pool_before, ckpt=ckpt, checkpoint_every=every)
    # the chunked reference's checkpoints are the same chunk-boundary states
    h0 = pool_before[case["state_indices"].long()].float() * case["has_init"].float()[:, None, None, None]
    _, _, ckpt_chunk = chunk_gated_delta_rule_ref(
        case["q"], case["k"], case["v"], case["g"], case["beta"], initial_state=h0, cu_seqlens=case["cu"],
        use_qk_l2norm=True, checkpoint_every=every)
    assert rel_err(ckpt, ckpt_chunk) < TOL


@pytest.mark.gpu
def test_stages_match_chunk_reference():
    """The prep kernel's workspaces vs the chunk reference's intermediates: tells which kernel
    is wrong. ``T diag(beta)`` is checked through what it produces: ``w = T diag(beta) exp(G) k``
    and ``u = T diag(beta) v``."""
    from qla_serving.kernels.chunk_prefill import _kernel_set, _launch, static_config

    lens = [65, 130, 7]
    case = _make_case(lens, 2, 8, beta_dtype=torch.bfloat16)
    pool_before = case["pool"].clone()
    out = torch.full_like(case["v"], float("nan"))
    q, k, v = case["q"], case["k"], case["v"]
    cfg = static_config(q, v, case["beta"], case["pool"], True)
    ws = _launch(cfg, _kernel_set(cfg), (q, k, case["g"], case["beta"]), (q, k, v), q.shape[0], scale=K**-0.5, plan=case["plan"], state_pool=case["pool"],
                 state_indices=case["state_indices"], has_initial_state=case["has_init"], checkpoints=None, out=out)
    h0 = pool_before[case["state_indices"].long()].float() * case["has_init"].float()[:, None, None, None]
    *_, inter = chunk_gated_delta_rule_ref(
        case["q"], case["k"], case["v"], case["g"], case["beta"], initial_state=h0, cu_seqlens=case["cu"],
        use_qk_l2norm=True, return_intermediates=True)
    NC, HV = ws["g_cum"].shape[:2]
    # the chunk-padded inputs, [NC, C, HV, D], the way the reference pads them
    k_chunks = torch.zeros(NC, 64, HV, K, device="cuda")
    v_chunks = torch.zeros(NC, 64, HV, V, device="cuda")
    mask = torch.zeros(NC, 64, dtype=torch.bool, device="cuda")
    kn = l2norm(case["k"].float()).repeat_interleave(HV // case["k"].shape[1], dim=1)
    H = case["k"].shape[1]
    # 1 / |q_i| and 1 / |k_i| per chunk row and q/k head (chunk_fwd keeps q and k raw)
    rnorm = torch.zeros(NC, 64, H, 2, device="cuda")
    for ci, (s, j) in enumerate(case["plan"].chunk_indices.cpu().tolist()):
        bos = int(case["cu"][s]) + 64 * j
        n = min(64, int(case["cu"][s + 1]) - bos)
        k_chunks[ci, :n] = kn[bos:bos + n]
        v_chunks[ci, :n] = case["v"][bos:bos + n].float()
        mask[ci, :n] = True
        for r, x in enumerate((case["q"], case["k"])):
            rnorm[ci, :n, :, r] = x[bos:bos + n].float().norm(dim=-1).reciprocal()
    G = ws["g_cum"].permute(0, 2, 1)  # [NC, C, HV]
    tb = ws["t_beta"].float().permute(0, 2, 1, 3)  # [NC, C(row), HV, C(col)]
    w = torch.einsum("nihj,njhd->nihd", tb, k_chunks * G.exp()[..., None])
    u = torch.einsum("nihj,njhd->nihd", tb, v_chunks)
    errs = {
        "g_cum": rel_err(G[mask], inter.g_cum[mask]),
        "w": rel_err(w[mask], inter.w[mask]),
        "u": rel_err(u[mask], inter.u[mask]),
        "qk_rnorm": rel_err(ws["qk_rnorm"].permute(0, 3, 1, 2)[mask], rnorm[mask]),
    }
    assert all(e < TOL for e in errs.values()), errs
    assert float(tb[~mask].abs().max()) == 0.0, "t_beta rows past a chunk's end must be zero"


@pytest.mark.gpu
def test_no_compile_across_50_batch_compositions():
    from qla_serving.kernels import chunk_prefill

    chunk_prefill.warmup(2, 8, dtype=torch.bfloat16, beta_dtype=torch.bfloat16, pool_dtype=torch.float32)
    before = chunk_prefill.compile_count()
    rng = random.Random(torch.initial_seed())
    checked = 0
    for i in range(50):
        lens = [rng.choice([1, 2, 63, 64, 65, rng.randint(1, 400)]) for _ in range(rng.randint(1, 6))]
        case = _make_case(lens, 2, 8, beta_dtype=torch.bfloat16)
        pool_before = case["pool"].clone() if i % 10 == 0 else None
        out = _run(case)
        assert torch.isfinite(out).all()
        if pool_before is not None:  # spot-check numerics along the way
            _check_against_oracle(case, out, pool_before)
            checked += 1
    assert chunk_prefill.compile_count() == before, "a batch composition triggered a compile"
    assert checked == 5


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """With a plan the op makes no host sync and allocates only through the caching allocator:
    it captures, and replays correctly on new inputs copied into the captured buffers."""
    from qla_serving.kernels import chunk_prefill

    lens = [100, 64, 1, 300]
    case = _make_case(lens, 2, 8, beta_dtype=torch.bfloat16)
    chunk_prefill.warmup(2, 8, dtype=torch.bfloat16, beta_dtype=torch.bfloat16, pool_dtype=torch.float32)
    out = torch.empty_like(case["v"])
    pool_start = case["pool"].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(case, out=out)  # warm-up on the side stream (first-use allocations)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    case["pool"].copy_(pool_start)
    with torch.cuda.graph(graph):
        _run(case, out=out)
    # new inputs into the captured buffers, fresh start states, poisoned output
    fresh = _make_case(lens, 2, 8, beta_dtype=torch.bfloat16)
    for name in ("q", "k", "v", "g", "beta"):
        case[name].copy_(fresh[name])
    case["pool"].normal_()
    pool_before = case["pool"].clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check_against_oracle(case, out, pool_before)


def _gates(T, HV, kind, dev="cuda"):
    """Per-token log decays ``[T, HV]`` float32 and ``beta [T, HV]``.

    ``qwen``: ``-exp(A_log) softplus(a + dt_bias)`` with A_log spread over [-4, 1.5] across the
    heads (from barely decaying to strongly decaying). ``adversarial``: a quarter of the heads
    with g = 0 (no decay at all), a quarter alternating 256-token stretches of strong decay
    and none, the rest Qwen-like.
    """
    a, b = torch.randn(T, HV, device=dev), torch.randn(T, HV, device=dev)
    A_log = torch.linspace(-4.0, 1.5, HV, device=dev)
    dt_bias = torch.empty(HV, device=dev).uniform_(-3.0, 0.0)
    g, beta = gdn_gate_ref(a, b, A_log, dt_bias, dtype=torch.float32)
    if kind == "adversarial":
        q = max(HV // 4, 1)
        g[:, :q] = 0.0
        stretch = (torch.arange(T, device=dev) // 256) % 2 == 0
        g[:, q:2 * q] = torch.where(stretch[:, None], torch.full_like(g[:, q:2 * q], -0.5), 0.0)
    return g.contiguous(), beta


@pytest.mark.gpu
@pytest.mark.parametrize("lens,kind", [
    ([20000], "qwen"),
    ([20000], "adversarial"),
    ([9000, 300, 4100], "qwen"),  # a long prompt with short ones, several long ones
    ([131072], "qwen"),
])
def test_context_parallel_matches_non_cp(lens, kind):
    """AutoCP (segments with warm-up or exact replay, decided per head on the device) against
    the float64 oracle: its error at most 1.1x the non-CP path's on the same inputs; initial
    states from the pool, checkpoints."""
    H, HV = 2, 8
    # adversarial gates make heads fall back to replaying from the sequence start, which reads
    # the initial state after the kernel's decay check: every sequence gets one there
    case = _make_case(lens, H, HV, beta_dtype=torch.bfloat16, checkpoint_every=1024,
                      init_frac=1.0 if kind == "adversarial" else 0.5)
    case["g"], beta = _gates(sum(lens), HV, kind)
    case["beta"] = beta.to(torch.bfloat16)
    pool_before = case["pool"].clone()
    o_ref, final_ref, ckpt_ref = _oracle(case, pool_before, checkpoint_every=1024)
    errs = {}
    for name, seg in (("nocp", 0), ("cp", 1024)):
        case["pool"].copy_(pool_before)
        case["plan"] = plan_prefill(case["cu"], device="cuda", checkpoint_every=1024, num_v_heads=HV,
                                    cp_segment_tokens=seg)
        assert (case["plan"].context_parallel is not None) == (seg > 0)
        ckpt = torch.full((case["plan"].num_checkpoints, HV, V, K), float("nan"), device="cuda")
        out = _run(case, checkpoints=ckpt)
        assert torch.isfinite(out).all() and torch.isfinite(ckpt).all()
        final = case["pool"][case["state_indices"].long()]
        errs[name] = (rel_err(out, o_ref), rel_err(final, final_ref), rel_err(ckpt, ckpt_ref))
        assert errs[name][0] < TOL and errs[name][1] < TOL and errs[name][2] < TOL, (name, errs[name])
    for i, what in enumerate(("o", "final state", "checkpoints")):
        assert errs["cp"][i] <= 1.1 * errs["nocp"][i] + 1e-6, (what, errs)


def _packed_case(lens, H, HV, *, dtype=torch.bfloat16, pool_dtype=torch.float32, bias_dtype=torch.bfloat16):
    """The engines' own buffers: one conv output ``[T, (2H + HV) K]`` holding q, k and v, and the
    gate inputs a and b as the two halves of one projection (a token stride of 2 HV)."""
    case = _make_case(lens, H, HV, dtype=dtype, pool_dtype=pool_dtype)
    T = sum(lens)
    dev = "cuda"
    qkv = torch.randn(T, (2 * H + HV) * K, device=dev).to(dtype)
    ab = torch.randn(T, 2 * HV, device=dev).to(dtype)
    a, b = ab[:, :HV], ab[:, HV:]
    A_log = torch.empty(HV, device=dev).uniform_(0.0, 1.5)
    dt_bias = torch.empty(HV, device=dev).uniform_(-3.0, 0.0).to(bias_dtype)
    q, k, v = qkv.split([H * K, H * K, HV * V], dim=-1)
    g, beta = gdn_gate_ref(a, b, A_log, dt_bias, dtype=torch.float32)
    case.update(q=q.reshape(T, H, K), k=k.reshape(T, H, K), v=v.reshape(T, HV, V), g=g, beta=beta, l2=True,
                qkv=qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    return case


@pytest.mark.gpu
@pytest.mark.parametrize("lens,H,HV", [([1, 63, 64, 65, 130, 1], 2, 8), ([700, 3, 129], 4, 16), ([1500], 16, 32)])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_packed_inputs_match_oracle_and_the_classic_kernels(lens, H, HV, pool_dtype):
    """The packed-inputs kernels (q, k, v read in the conv output, the gates made from a and b in
    prep) against the float64 oracle on the same values, and against the classic kernels given
    the same values split, contiguous, and gated by the float32 reference: the same result up to
    the gates' rounding."""
    from qla_serving import chunk_gated_delta_rule_pool_packed
    from qla_serving.kernels.chunk_prefill import compile_count

    case = _packed_case(lens, H, HV, pool_dtype=pool_dtype)
    pool_before = case["pool"].clone()
    out = torch.full_like(case["v"], float("nan"))
    compiled = compile_count()
    o = chunk_gated_delta_rule_pool_packed(
        case["qkv"], case["a"], case["b"], case["A_log"], case["dt_bias"], case["pool"], case["state_indices"],
        num_qk_heads=H, plan=case["plan"], has_initial_state=case["has_init"], out=out)
    assert o.data_ptr() == out.data_ptr()
    _check_against_oracle(case, out, pool_before)
    packed_pool = case["pool"].clone()
    case["pool"].copy_(pool_before)
    classic = _run({**case, "q": case["q"].contiguous(), "k": case["k"].contiguous(), "v": case["v"].contiguous()})
    assert rel_err(out, classic) < TOL / 4, rel_err(out, classic)
    idx = case["state_indices"].long()
    assert rel_err(packed_pool[idx], case["pool"][idx]) < TOL / 4
    assert compile_count() - compiled <= 2  # the packed set (library or TileLang) and the classic one


@pytest.mark.gpu
def test_packed_inputs_in_a_cuda_graph_with_autocp():
    """The packed kernels captured in a CUDA graph over an AutoCP plan (a long sequence split into
    segments), replayed on new values in the same buffers: the replay equals an eager call."""
    from qla_serving import chunk_gated_delta_rule_pool_packed

    H, HV = 2, 8
    case = _packed_case([9000, 300], H, HV)
    case["plan"] = plan_prefill(case["cu"], device="cuda", num_v_heads=HV, cp_segment_tokens=1024)
    assert case["plan"].context_parallel is not None
    out = torch.empty_like(case["v"])
    pool_before = case["pool"].clone()

    def call():
        chunk_gated_delta_rule_pool_packed(
            case["qkv"], case["a"], case["b"], case["A_log"], case["dt_bias"], case["pool"], case["state_indices"],
            num_qk_heads=H, plan=case["plan"], has_initial_state=case["has_init"], out=out)

    call()  # loads (or compiles) the kernels before capture
    case["pool"].copy_(pool_before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    case["qkv"].copy_(torch.randn_like(case["qkv"], dtype=torch.float32).to(case["qkv"].dtype))
    case["pool"].copy_(pool_before)
    graph.replay()
    torch.cuda.synchronize()
    replayed, replayed_pool = out.clone(), case["pool"].clone()
    case["pool"].copy_(pool_before)
    call()
    assert torch.equal(replayed, out) and torch.equal(replayed_pool, case["pool"])
