"""Every bad input raises an error that names the constraint."""

import pytest
import torch
from helpers import cu_of

import qla_serving

H, HV, K = 2, 4, 16


def prefill_args(T=20, **over):
    a = dict(q=torch.randn(T, H, K), k=torch.randn(T, H, K), v=torch.randn(T, HV, K),
             g=-torch.rand(T, HV), beta=torch.rand(T, HV), state_pool=torch.zeros(4, HV, K, K),
             state_indices=torch.tensor([1, 3], dtype=torch.int32), cu_seqlens=cu_of([5, T - 5]))
    a.update(over)
    return a


def decode_args(N=3, T=1, **over):
    a = dict(q=torch.randn(N, T, H, K), k=torch.randn(N, T, H, K), v=torch.randn(N, T, HV, K),
             a=torch.randn(N, T, HV), b=torch.randn(N, T, HV), A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
             state_pool=torch.zeros(5, HV, K, K), state_indices=torch.tensor([0, 4, -1], dtype=torch.int32)[:N])
    a.update(over)
    return a


def prefill(**over):
    return qla_serving.chunk_gated_delta_rule_pool(**prefill_args(**over))


def decode(**over):
    return qla_serving.gated_delta_rule_decode(**decode_args(**over))


def test_valid_calls_pass():
    """The arguments every bad case below starts from are valid: the calls return outputs of the
    documented shapes, with the padded decode row zero."""
    o = prefill()
    assert o.shape == (20, HV, K) and torch.isfinite(o).all()
    od = decode()
    assert od.shape == (3, 1, HV, K) and torch.isfinite(od).all()
    assert torch.count_nonzero(od[2]) == 0 and torch.count_nonzero(od[0]) > 0


PREFILL_BAD = [
    ("q rank", dict(q=torch.randn(20, H)), ValueError, "q must have rank"),
    ("k shape", dict(k=torch.randn(20, H, K + 1)), ValueError, r"k must have shape \(20, 2, 16\)"),
    ("v tokens", dict(v=torch.randn(19, HV, K)), ValueError, "v has 19 tokens"),
    ("GVA", dict(v=torch.randn(20, 3, K), g=torch.zeros(20, 3), beta=torch.zeros(20, 3)), ValueError,
     "multiple of q/k heads"),
    ("g shape", dict(g=torch.zeros(20, HV + 1)), ValueError, r"g must have shape \(20, 4\)"),
    ("beta shape", dict(beta=torch.zeros(21, HV)), ValueError, "beta must have shape"),
    ("q dtype", dict(q=torch.randint(0, 3, (20, H, K))), TypeError, "q has dtype int64"),
    ("k dtype", dict(k=torch.randn(20, H, K, dtype=torch.float64)), TypeError, "q, k and v must share a dtype"),
    ("g dtype", dict(g=torch.zeros(20, HV, dtype=torch.float64)), TypeError, "g has dtype float64"),
    ("pool dtype", dict(state_pool=torch.zeros(4, HV, K, K, dtype=torch.float16)), TypeError, "state_pool has dtype"),
    ("pool shape", dict(state_pool=torch.zeros(4, HV, K, K + 1)), ValueError, r"state_pool must be \[num_slots"),
    ("pool layout", dict(state_pool=torch.zeros(4, HV, K, K).transpose(-1, -2)), ValueError, "contiguous"),
    ("device", dict(state_pool=torch.zeros(4, HV, K, K, device="meta")), ValueError, "all tensors must be on one device"),
    ("non-contiguous q", dict(q=torch.randn(H, 20, K).transpose(0, 1)), ValueError, "q must be contiguous"),
    ("index range", dict(state_indices=torch.tensor([1, 4], dtype=torch.int32)), IndexError, r"slot range \[0, 4\)"),
    ("negative index", dict(state_indices=torch.tensor([-1, 2], dtype=torch.int32)), IndexError, "slot range"),
    ("duplicate slot", dict(state_indices=torch.tensor([2, 2], dtype=torch.int32)), ValueError, "names a slot twice"),
    ("index count", dict(state_indices=torch.tensor([1], dtype=torch.int32)), ValueError, "one slot per sequence"),
    ("index dtype", dict(state_indices=torch.tensor([1.0, 2.0])), TypeError, "state_indices has dtype float32"),
    ("token count", dict(cu_seqlens=cu_of([5, 10])), ValueError, "covers 15 tokens but q has 20"),
    ("cu_seqlens start", dict(cu_seqlens=torch.tensor([1, 5, 20])), ValueError, r"cu_seqlens\[0\] must be 0"),
    ("cu_seqlens order", dict(cu_seqlens=torch.tensor([0, 15, 5, 20]),
                              state_indices=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "non-decreasing"),
    ("has_initial_state dtype", dict(has_initial_state=torch.ones(2)), TypeError, "has_initial_state has dtype"),
    ("checkpoints without every", dict(checkpoints=torch.zeros(0, HV, K, K)), ValueError, "no checkpoint_every"),
    ("checkpoint every", dict(checkpoint_every=100), ValueError, "multiple of 64"),
    ("out dtype", dict(out=torch.empty(20, HV, K, dtype=torch.float64)), TypeError, "out has dtype"),
    ("batch", dict(q=torch.randn(2, 10, H, K)), ValueError, "batch dim 2"),
]


@pytest.mark.parametrize("over,exc,match", [c[1:] for c in PREFILL_BAD], ids=[c[0] for c in PREFILL_BAD])
def test_prefill_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        prefill(**over)


def test_prefill_checkpoint_shape():
    with pytest.raises(ValueError, match=r"checkpoints must have shape \(2, 4, 16, 16\)"):
        prefill(T=133, cu_seqlens=cu_of([5, 128]), checkpoint_every=64, checkpoints=torch.zeros(3, HV, K, K))


def test_prefill_needs_offsets():
    a = prefill_args()
    del a["cu_seqlens"]
    with pytest.raises(ValueError, match="give plan, cu_seqlens or cu_seqlens_cpu"):
        qla_serving.chunk_gated_delta_rule_pool(**a)


DECODE_BAD = [
    ("q rank", dict(q=torch.randn(3, H)), ValueError, "q must have rank 3 or 4"),
    ("too many tokens", dict(T=17), ValueError, "1 to 16 tokens per sequence, got T=17"),
    ("GVA", dict(v=torch.randn(3, 1, 3, K)), ValueError, "multiple of q/k heads"),
    ("a shape", dict(a=torch.randn(3, 1, HV + 1)), ValueError, "a must have shape"),
    ("A_log shape", dict(A_log=torch.zeros(HV, 1)), ValueError, r"A_log must have shape \(4,\)"),
    ("dt_bias dtype", dict(dt_bias=torch.zeros(HV, dtype=torch.int32)), TypeError, "dt_bias has dtype int32"),
    ("index range", dict(state_indices=torch.tensor([0, 5, -1], dtype=torch.int32)), IndexError, "or -1 for a padded row"),
    ("index below -1", dict(state_indices=torch.tensor([0, -2, 1], dtype=torch.int32)), IndexError, "slot range"),
    ("pool dims", dict(state_pool=torch.zeros(5, HV, K + 1, K)), ValueError, r"state_pool must be \[num_slots"),
    ("device", dict(A_log=torch.zeros(HV, device="meta")), ValueError, "A_log is on meta"),
    ("intermediate dtype", dict(intermediate_states=torch.zeros(3, 1, HV, K, K, dtype=torch.bfloat16)), TypeError,
     "must match the pool's"),
    ("intermediate shape", dict(intermediate_states=torch.zeros(3, 2, HV, K, K)), ValueError,
     "intermediate_states must have shape"),
]


@pytest.mark.parametrize("over,exc,match", [c[1:] for c in DECODE_BAD], ids=[c[0] for c in DECODE_BAD])
def test_decode_bad_input(over, exc, match):
    T = over.pop("T", 1)
    with pytest.raises(exc, match=match):
        decode(T=T, **over)


FLA_BAD = [
    ("rank", dict(q=torch.randn(20, H, K)), ValueError, r"q must have rank 4 \(\[B, T, H, K\]\)"),
    ("varlen batch", dict(cu_seqlens=torch.tensor([0, 10])), ValueError, "needs batch size 1"),
    ("state shape", dict(initial_state=torch.zeros(2, HV, K, K + 1)), ValueError, r"initial_state must have shape"),
    ("leading dims", dict(g=torch.zeros(2, 9, HV)), ValueError, "g has leading dims"),
]


@pytest.mark.parametrize("over,exc,match", [c[1:] for c in FLA_BAD], ids=[c[0] for c in FLA_BAD])
def test_fla_api_bad_input(over, exc, match):
    a = dict(q=torch.randn(2, 10, H, K), k=torch.randn(2, 10, H, K), v=torch.randn(2, 10, HV, K),
             g=torch.zeros(2, 10, HV), beta=torch.zeros(2, 10, HV))
    a.update(over)
    with pytest.raises(exc, match=match):
        qla_serving.chunk_gated_delta_rule(**a)
