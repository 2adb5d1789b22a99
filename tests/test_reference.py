"""The chunked (WY) reference against the token-by-token float64 oracle."""

import pytest
import torch

from qla_serving.ops.gated_delta_rule.naive import (
    chunk_gated_delta_rule_ref,
    recurrent_decode_ref,
    recurrent_gated_delta_rule_ref,
)

from helpers import GATE_MODES, cu_of, make_gates, make_qkv, rel_err

LENGTHS = {
    "1": [1],
    "63": [63],
    "64": [64],
    "65": [65],
    "129": [129],
    "mixed": [1, 63, 64, 65, 129],
    "mixed2": [130, 7, 64],
}
GVA = [(4, 4), (2, 4), (2, 6), (1, 4), (1, 8)]  # ratios 1, 2, 3, 4, 8


def _run_pair(lengths, H, HV, mode, with_init, dtype, K=32, V=32, checkpoint_every=None):
    T = sum(lengths)
    q, k, v = make_qkv(T, H, HV, K, V)
    g, beta = make_gates(T, HV, mode)
    N = len(lengths)
    h0 = torch.randn(N, HV, V, K, dtype=torch.float64) if with_init else None
    cu = cu_of(lengths)
    kw = dict(initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True, checkpoint_every=checkpoint_every)
    ref = recurrent_gated_delta_rule_ref(q, k, v, g, beta, **kw)
    got = chunk_gated_delta_rule_ref(q, k, v, g, beta, dtype=dtype, **kw)
    return ref, got


@pytest.mark.parametrize("with_init", [False, True], ids=["h0=0", "h0"])
@pytest.mark.parametrize("mode", GATE_MODES)
@pytest.mark.parametrize("heads", GVA, ids=lambda h: f"{h[0]}/{h[1]}")
@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
def test_chunk_float64_matches_oracle(lengths, heads, mode, with_init):
    (o_r, s_r, _), (o, s, _) = _run_pair(lengths, *heads, mode, with_init, torch.float64)
    assert rel_err(o, o_r) <= 1e-10
    assert rel_err(s, s_r) <= 1e-10


@pytest.mark.parametrize("with_init", [False, True], ids=["h0=0", "h0"])
@pytest.mark.parametrize("mode", GATE_MODES)
@pytest.mark.parametrize("heads", [(2, 4), (1, 8), (2, 6)], ids=lambda h: f"{h[0]}/{h[1]}")
@pytest.mark.parametrize("lengths", [LENGTHS["mixed"], LENGTHS["mixed2"]], ids=["mixed", "mixed2"])
def test_chunk_float32_within_rounding(lengths, heads, mode, with_init):
    (o_r, s_r, _), (o, s, _) = _run_pair(lengths, *heads, mode, with_init, torch.float32)
    assert o.dtype == torch.float32
    # float32 rounding through a 64-step triangular solve and the chunk recurrence.
    assert rel_err(o, o_r) <= 2e-5
    assert rel_err(s, s_r) <= 2e-5


@pytest.mark.parametrize("every", [64, 128])
def test_checkpoints_are_the_oracle_states(every):
    lengths = [300, 64, 5, 128]
    (o_r, s_r, c_r), (o, s, c) = _run_pair(lengths, 2, 4, "qwen", True, torch.float64, checkpoint_every=every)
    assert c.shape[0] == sum(L // every for L in lengths) == c_r.shape[0]
    assert rel_err(c, c_r) <= 1e-10
    # A checkpoint at a sequence's end is its final state.
    assert torch.allclose(c[-1], s[-1]) and every <= 128


def test_head_dim_128_and_long_sequence():
    (o_r, s_r, _), (o, s, _) = _run_pair([513], 2, 4, "qwen", True, torch.float32, K=128, V=128)
    assert rel_err(o, o_r) <= 2e-5 and rel_err(s, s_r) <= 2e-5


def test_intermediates_reassemble_the_output():
    """w, u, v_new and h of each chunk satisfy the WY relations of docs/design.md."""
    lengths = [100, 64]
    T, H, HV, K = sum(lengths), 1, 2, 16
    q, k, v = make_qkv(T, H, HV, K, K)
    g, beta = make_gates(T, HV, "mild")
    o, s, _, inter = chunk_gated_delta_rule_ref(q, k, v, g, beta, cu_seqlens=cu_of(lengths),
                                                return_intermediates=True, dtype=torch.float64)
    assert inter.h.shape == (3, HV, K, K)  # 2 chunks + 1 chunk
    # v_new = u - w h (h in the FLA layout is the transpose of the stored state).
    for c in range(3):
        w, u, vn, h = inter.w[c], inter.u[c], inter.v_new[c], inter.h[c]
        assert torch.allclose(vn, u - torch.einsum("chk,hvk->chv", w, h), atol=1e-12)
    # The first chunk of each sequence starts from zero.
    assert inter.h[0].abs().max() == 0 and inter.h[2].abs().max() == 0


def test_no_decay_no_write_keeps_state():
    """beta = 0 and g = 0: the state never changes and o = scale * S q."""
    T, H, HV, K = 10, 1, 2, 8
    q, k, v = make_qkv(T, H, HV, K, K)
    g, beta = torch.zeros(T, HV, dtype=torch.float64), torch.zeros(T, HV, dtype=torch.float64)
    h0 = torch.randn(1, HV, K, K, dtype=torch.float64)
    o, s, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0)
    assert torch.equal(s, h0)
    qe = q.repeat_interleave(HV // H, dim=1)
    assert torch.allclose(o, torch.einsum("hvk,thk->thv", h0[0], qe) * K**-0.5)


@pytest.mark.parametrize("T", [1, 2, 8])
@pytest.mark.parametrize("heads", [(2, 4), (1, 8)], ids=lambda h: f"{h[0]}/{h[1]}")
def test_decode_oracle_is_the_prefill_oracle(T, heads):
    """Decoding T tokens equals prefilling them with the gate computed from a, b."""
    H, HV = heads
    N, K = 3, 16
    q, k = torch.randn(N, T, H, K, dtype=torch.float64), torch.randn(N, T, H, K, dtype=torch.float64)
    v = torch.randn(N, T, HV, K, dtype=torch.float64)
    a, b = torch.randn(N, T, HV, dtype=torch.float64), torch.randn(N, T, HV, dtype=torch.float64)
    A_log, dt_bias = torch.empty(HV, dtype=torch.float64).uniform_(-4, 1.5), torch.randn(HV, dtype=torch.float64)
    h0 = torch.randn(N, HV, K, K, dtype=torch.float64)
    o, states = recurrent_decode_ref(q, k, v, a, b, A_log, dt_bias, h0)
    for n in range(N):
        g = -torch.exp(A_log) * torch.nn.functional.softplus(a[n] + dt_bias)
        o2, s2, _ = chunk_gated_delta_rule_ref(q[n], k[n], v[n], g, torch.sigmoid(b[n]),
                                               initial_state=h0[n:n + 1], use_qk_l2norm=True, dtype=torch.float64)
        assert rel_err(o[n], o2) <= 1e-10
        assert rel_err(states[n, -1], s2[0]) <= 1e-10
