"""The TileLang decode kernel against the float64 oracle ``recurrent_decode_ref``.

Fresh random inputs every run. Each case poisons the outputs (NaN) first, so an unwritten
element fails, and checks: outputs and states of live rows against the oracle, padded rows
(index -1) with zero output and untouched state and intermediates, every other slot and the
gap bytes of a strided pool bit-identical. GPU cases carry the ``gpu`` marker; the tile
table, its parsing and (where TileLang and nvcc are installed) the sm_90a build of every
tile variant are checked on the CPU.

``QLA_DECODE_COMPILE_ONLY=1`` (no GPU needed) runs the GPU cases as far as compiling the
kernel each one would launch, asserting nothing else: with ``TILELANG_CACHE_DIR`` set it fills
a cache the GPU machine then loads instead of compiling.
"""

import math
import os
import shutil

import pytest
import torch
from helpers import rel_err

from qla_serving.ops.gated_delta_rule.naive import recurrent_decode_ref

COMPILE_ONLY = os.environ.get("QLA_DECODE_COMPILE_ONLY") == "1"


def _unmarked(test):
    return test


gpu = _unmarked if COMPILE_ONLY else pytest.mark.gpu

K = V = 128


def _fwd():
    from qla_serving.kernels import decode

    return decode



def make_inputs(N, T, H, HV, act, gate_dtype=torch.float32, l2=True):
    dev = "cuda"
    scale_qk = 1.0 if l2 else K**-0.5  # without the L2 norm keep |k| ~ 1 so the state stays bounded
    q = (torch.randn(N, T, H, K, device=dev) * scale_qk).to(act)
    k = (torch.randn(N, T, H, K, device=dev) * scale_qk).to(act)
    v = torch.randn(N, T, HV, V, device=dev).to(act)
    a = torch.randn(N, T, HV, device=dev).to(act)
    b = torch.randn(N, T, HV, device=dev).to(act)
    A_log = torch.empty(HV, device=dev).uniform_(0, math.log(16)).to(gate_dtype)
    dt_bias = (torch.randn(HV, device=dev) * 0.5).to(gate_dtype)
    return q, k, v, a, b, A_log, dt_bias


def make_pool(num_slots, HV, dtype, gap):
    """A pool whose slots sit ``gap`` elements apart beyond HV*V*K (vLLM's shared buffer)."""
    per_slot = HV * V * K
    buf = torch.randn(num_slots, per_slot + gap, device="cuda").to(dtype)
    return buf, buf[:, gap:].view(num_slots, HV, V, K) if gap else buf.view(num_slots, HV, V, K)


def run_case(
    N,
    T,
    H,
    HV,
    pool_dtype,
    act=torch.bfloat16,
    *,
    gap=0,
    pad=0,
    inter=False,
    inplace=True,
    l2=True,
    idx_dtype=torch.int32,
    gate_dtype=torch.float32,
    packed=False,
    null_slot=False,
):
    """``packed``: q, k, v as column ranges of one ``[N*T, (2H + 2HV) K]`` buffer (vLLM's qkvz
    projection layout) and a, b as the halves of one ``[N*T, 2HV]`` buffer, read in place.
    ``null_slot``: padded rows point at slot 0 (vLLM's null block) with ``min_slot=1`` instead of -1."""
    dec = _fwd()
    if COMPILE_ONLY:  # the kernel this case launches (see the module docstring), nothing else
        tile = dec._tile_for(N * HV, pool_dtype)
        key = dec._key(
            H, HV, T, act, act, gate_dtype, gate_dtype, pool_dtype, idx_dtype, l2, inter, inplace, tile
        )
        dec._get_kernel(key)
        return
    num_slots = N + 3
    q, k, v, a, b, A_log, dt_bias = make_inputs(N, T, H, HV, act, gate_dtype, l2)
    if packed:
        qkvz = torch.randn(N * T, (2 * H + 2 * HV) * K, device="cuda").to(act)
        ba = torch.randn(N * T, 2 * HV, device="cuda").to(act)
        cols = [H * K, H * K, HV * V]
        views = qkvz[:, : sum(cols)].split(cols, dim=-1)
        for view, x in zip(views, (q, k, v)):
            view.copy_(x.reshape(N * T, -1))
        q, k, v = views[0].view(N, T, H, K), views[1].view(N, T, H, K), views[2].view(N, T, HV, V)
        ba[:, :HV], ba[:, HV:] = b.reshape(N * T, HV), a.reshape(N * T, HV)
        b, a = (x.view(N, T, HV) for x in ba.chunk(2, dim=-1))
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or a.is_contiguous())
    buf, pool = make_pool(num_slots, HV, pool_dtype, gap)
    before = buf.clone()
    first = 1 if null_slot else 0
    slots = torch.randperm(num_slots - first, device="cuda")[:N] + first
    if pad:
        slots[torch.randperm(N, device="cuda")[:pad]] = 0 if null_slot else -1
    idx = slots.to(idx_dtype)
    live = slots >= first
    out = torch.full((N, T, HV, V), float("nan"), device="cuda", dtype=act)
    inter_buf = torch.full((N, T, HV, V, K), float("nan"), device="cuda", dtype=pool_dtype) if inter else None
    scale = K**-0.5
    init = pool[slots.clamp_min(0).long()].clone()
    dec.gated_delta_rule_decode_fwd(
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        state_pool=pool,
        state_indices=idx,
        scale=scale,
        use_qk_l2norm=l2,
        out=out,
        intermediate_states=inter_buf,
        inplace_final_state=inplace,
        min_slot=first,
    )
    torch.cuda.synchronize()
    o_ref, states_ref = recurrent_decode_ref(
        q, k, v, a, b, A_log, dt_bias, init, scale=scale, use_qk_l2norm=l2
    )

    o_tol = 1e-2 if act != torch.float32 else 1e-4
    state_tol = 1e-4 if pool_dtype == torch.float32 else 1e-2
    if live.any():
        assert rel_err(out[live], o_ref[live]) < o_tol
    assert (out[~live] == 0).all(), "padded rows must have zero output"
    if inter:
        if live.any():
            assert rel_err(inter_buf[live], states_ref[live]) < state_tol
        assert torch.isnan(inter_buf[~live].float()).all(), "padded rows' intermediates must stay untouched"
    live_slots = slots[live].long()
    if inplace and live.any():
        assert rel_err(pool[live_slots], states_ref[live, -1]) < state_tol
    # Every element the kernel had no business writing is bit-identical.
    touched = torch.zeros(num_slots, dtype=torch.bool, device="cuda")
    if inplace:
        touched[live_slots] = True
    assert torch.equal(buf[~touched], before[~touched]), "untouched slots changed"
    if gap:
        assert torch.equal(buf[:, :gap], before[:, :gap]), "bytes between slots changed"


@gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,HV", [(16, 64), (2, 8), (4, 12)])
def test_single_token(pool_dtype, H, HV):
    run_case(N=9, T=1, H=H, HV=HV, pool_dtype=pool_dtype)


@gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [2, 3, 5, 9, 16])
def test_multi_token_with_intermediates(pool_dtype, T):
    run_case(N=6, T=T, H=4, HV=16, pool_dtype=pool_dtype, inter=True, pad=1)


@gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_verify_leaves_pool_alone(pool_dtype):
    # Speculative verify: intermediates only, pool untouched (the engine keeps the accepted prefix).
    run_case(N=5, T=4, H=2, HV=8, pool_dtype=pool_dtype, inter=True, inplace=False)


@gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_and_strided_pool(pool_dtype):
    run_case(N=40, T=1, H=16, HV=32, pool_dtype=pool_dtype, pad=13, gap=4 * 1024 + 8)


@gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,inter,inplace", [(1, False, True), (4, True, False)])
def test_packed_views_and_null_slot(pool_dtype, T, inter, inplace):
    """vLLM's decode: q/k/v/a/b read in place from the packed conv output and gate projection,
    padded rows on its null slot 0 (``min_slot=1``); and its verify (T = 4, intermediates)."""
    run_case(N=37, T=T, H=4, HV=16, pool_dtype=pool_dtype, pad=5, gap=1024, inter=inter, inplace=inplace,
             packed=True, null_slot=True)


@gpu
def test_all_rows_padded():
    run_case(N=4, T=2, H=2, HV=8, pool_dtype=torch.float32, pad=4, inter=True)


@gpu
def test_fp16_int64_indices_bf16_gate_no_l2norm():
    run_case(
        N=7,
        T=2,
        H=2,
        HV=8,
        pool_dtype=torch.float32,
        act=torch.float16,
        idx_dtype=torch.int64,
        gate_dtype=torch.bfloat16,
        l2=False,
        inter=True,
    )


@gpu
def test_large_batch_fp32():
    run_case(N=300, T=1, H=16, HV=48, pool_dtype=torch.float32, pad=20)


@gpu
def test_runtime_batch_size_compiles_once():
    dec = _fwd()
    dec.warmup(4, 16, 1, dtype=torch.bfloat16, pool_dtype=torch.float32)
    before = dec.compiled_kernels()
    for N in (1, 3, 17, 64, 129):
        run_case(N=N, T=1, H=4, HV=16, pool_dtype=torch.float32)
    assert dec.compiled_kernels() == before, "a new batch size must not recompile"


@gpu
def test_cuda_graph_capture_and_replay():
    dec = _fwd()
    N, T, H, HV = 24, 2, 4, 16
    act, pool_dtype = torch.bfloat16, torch.float32
    dec.warmup(H, HV, T, dtype=act, pool_dtype=pool_dtype, intermediate_states=True)
    if COMPILE_ONLY:
        return
    compiled = dec.compiled_kernels()
    inputs = [x.clone() for x in make_inputs(N, T, H, HV, act)]
    _, pool = make_pool(N + 8, HV, pool_dtype, gap=0)
    idx = torch.randperm(N + 8, device="cuda")[:N].int()
    idx[3] = -1
    out = torch.empty(N, T, HV, V, device="cuda", dtype=act)
    inter = torch.empty(N, T, HV, V, K, device="cuda", dtype=pool_dtype)

    def step():
        dec.gated_delta_rule_decode_fwd(
            *inputs,
            state_pool=pool,
            state_indices=idx,
            scale=K**-0.5,
            use_qk_l2norm=True,
            out=out,
            intermediate_states=inter,
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):  # new data in the captured buffers each replay
        for x, y in zip(inputs, make_inputs(N, T, H, HV, act)):
            x.copy_(y)
        live = idx >= 0
        init = pool[idx.clamp_min(0).long()].clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, st_ref = recurrent_decode_ref(*inputs, init, scale=K**-0.5, use_qk_l2norm=True)
        assert rel_err(out[live], o_ref[live]) < 1e-2
        assert (out[~live] == 0).all()
        assert rel_err(pool[idx[live].long()], st_ref[live, -1]) < 1e-4
        assert rel_err(inter[live], st_ref[live]) < 1e-4
    assert dec.compiled_kernels() == compiled


# Tile variants: each must give the reference's numbers, whatever the tile.
TILE_VARIANTS = ["32x128", "16x128", "32x64s", "8x32s", "32x64l4s", "64x128l16", "32x32l32s", "32x64b12s"]


@gpu
@pytest.mark.parametrize("tile", TILE_VARIANTS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_every_tile_variant(tile, pool_dtype, T):
    dec = _fwd()
    parsed = dec.DecodeTile.parse(tile)
    try:
        parsed.check("float32" if pool_dtype == torch.float32 else "bfloat16")
    except ValueError:
        pytest.skip(f"tile {tile} does not apply to a {pool_dtype} pool")
    with dec.force_tile(parsed):
        run_case(N=12, T=T, H=2, HV=8, pool_dtype=pool_dtype, pad=3, gap=4 * 1024 + 8, inter=T > 1)


# CPU: the tile table and its text form.


def test_tile_text_round_trip():
    from qla_serving.kernels.decode import LANES_PER_ROW, DecodeTile

    for text in ["32x64", "64x128l16", "32x64b8", "8x32l32s", "32x64l4b12s", "16x128"]:
        assert str(DecodeTile.parse(text)) == text
    tile = DecodeTile.parse("32x64l4b12s")
    assert tile == DecodeTile(32, 64, 4, 12, True)
    assert DecodeTile.parse("16x128") == DecodeTile(16, 128, LANES_PER_ROW, 0, False)


@pytest.mark.parametrize(
    "text,dtype,message",
    [
        ("32x64x", "float32", "expected ROWSxTHREADS"),
        ("32x64late", "float32", "expected ROWSxTHREADS"),  # the old load order is gone
        ("32x64l32", "bfloat16", "lanes_per_row <= 16"),
        ("32x64l3", "float32", "must be 4, 8, 16 or 32"),
        ("48x64", "float32", "must divide 128"),
        ("8x128", "float32", "multiple of threads / lanes_per_row = 16"),
        ("32x48", "float32", "multiple of 32"),
    ],
)
def test_bad_tiles_name_the_constraint(text, dtype, message):
    from qla_serving.kernels.decode import DecodeTile

    with pytest.raises(ValueError, match=message):
        DecodeTile.parse(text).check(dtype)


def test_configured_tiles_both_forms(monkeypatch):
    from qla_serving.kernels import decode, decode_tiles

    legacy = {
        "float32": {"rows_per_cta": 32, "threads": 128, "small_rows_per_cta": 16, "small_threads": 128},
        "bfloat16": {
            "rows_per_cta": 32,
            "threads": 64,
            "lanes_per_row": 4,
            "small_rows_per_cta": 16,
            "small_threads": 128,
        },
        "small_max_pairs": 128,
    }
    monkeypatch.setattr(decode_tiles, "DECODE_CONFIGS", legacy)
    assert str(decode._tile_for(128, torch.float32)) == "16x128"
    assert str(decode._tile_for(129, torch.float32)) == "32x128"
    assert str(decode._tile_for(10**6, torch.bfloat16)) == "32x64l4"
    bands = {
        "float32": {"bands": [(64, "8x32s"), (4096, "16x64s"), (None, "32x128")]},
        "bfloat16": {"bands": [(None, (32, 64, 8, 0, True))]},
    }
    monkeypatch.setattr(decode_tiles, "DECODE_CONFIGS", bands)
    assert [str(decode._tile_for(p, torch.float32)) for p in (1, 64, 65, 4096, 4097)] == [
        "8x32s",
        "8x32s",
        "16x64s",
        "16x64s",
        "32x128",
    ]
    assert str(decode._tile_for(5, torch.bfloat16)) == "32x64s"
    with decode.force_tile("64x64"):
        assert str(decode._tile_for(5, torch.bfloat16)) == "64x64"
        with decode.force_tile("8x32"):
            assert str(decode._tile_for(5, torch.float32)) == "8x32"
        assert str(decode._tile_for(5, torch.float32)) == "64x64"
    assert str(decode._tile_for(5, torch.bfloat16)) == "32x64s"
    monkeypatch.setattr(decode_tiles, "DECODE_CONFIGS", {"float32": {"bands": [(64, "8x32")]}})
    with pytest.raises(ValueError, match="last band must have no pair limit"):
        decode._tile_for(1, torch.float32)
    monkeypatch.setattr(decode_tiles, "DECODE_CONFIGS", {"bfloat16": {"bands": [(None, "32x64l32")]}})
    with pytest.raises(ValueError, match="lanes_per_row <= 16"):
        decode._tile_for(1, torch.bfloat16)


def test_shipped_configs_are_valid():
    from qla_serving.kernels import decode

    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        tiles = decode._configured_tiles(name)
        assert tiles[-1][0] is None
        assert decode._tile_for(1, dtype) in [t for _, t in tiles]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build for sm_90a")
@pytest.mark.parametrize(
    "tile,pool_dtype,T,inter,inplace",
    [
        ("32x64s", torch.bfloat16, 1, False, True),
        ("32x32l32s", torch.float32, 1, True, True),
        ("32x64l4b12s", torch.bfloat16, 3, True, True),
        ("16x128l16", torch.float32, 2, True, False),
        ("32x64l4", torch.bfloat16, 2, True, True),
    ],
)
def test_tile_variants_build_for_sm90a(tile, pool_dtype, T, inter, inplace):
    """TileLang compiles without a GPU: every code path of the kernel must build."""
    pytest.importorskip("tilelang")
    from qla_serving.kernels import decode

    f32, bf16 = torch.float32, torch.bfloat16
    key = decode._key(
        2,
        8,
        T,
        bf16,
        bf16,
        f32,
        f32,
        pool_dtype,
        torch.int32,
        True,
        inter,
        inplace,
        decode.DecodeTile.parse(tile),
    )
    kernel = decode._get_kernel(key)
    source = kernel.get_kernel_source()
    assert "gdn_decode" in source
    blocks = decode.DecodeTile.parse(tile).min_blocks
    if blocks:
        assert (
            f", {blocks})" in source.split("gdn_decode_kernel(")[1].split("\n")[0] or f", {blocks})" in source
        )
