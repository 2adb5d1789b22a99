"""Steps of a speculative server where drafts come and go (vLLM's ``ngram``), against a float64 oracle.

An ``ngram`` proposer drafts up to ``num_speculative_tokens`` per request and may draft none, so
one step mixes rows with drafts of unequal length and rows without, and a step without drafts
can follow one that accepted several. vLLM's metadata reads a row without drafts from
block-table column 0, while the state after an accepted draft sits in column ``accepted - 1``
(vLLM #39273).
The layer must carry every request's state through all of that: each step's output, token by
token, equals the float64 recurrence (conv, gate, delta rule) over the tokens the request has
accepted so far followed by this step's tokens.

The steps go through vLLM's own builder (ours, a subclass) the way the GPU model runner calls
it: the runner's accepted-count buffer sliced on steps with drafts, nothing on steps without.
On the CPU the layer runs the ops' PyTorch reference and the conv's PyTorch form; on a GPU
(``gpu`` marker) the same steps run our kernels and vLLM's Triton conv.
"""

from __future__ import annotations

import pytest
import torch
from qla_vllm_helpers import build_gdn_layer, common_metadata, engine_config, metadata_builder
from test_vllm_forward import conv_oracle

from qla_serving.ops.gated_delta_rule.naive import gdn_gate_ref, recurrent_gated_delta_rule_ref

NUM_SPEC = 2
NUM_SLOTS = 16

# Per step: each request's (tokens, drafts) — drafts -1: no drafts (the runner's
# num_decode_draft_tokens), tokens = drafts + 1 otherwise — and how many it accepts (a row
# without drafts accepts its one token). Step 0 is the prefill of all three.
STEPS = [
    dict(tokens=[20, 9, 13], drafts=None, accept=None),
    dict(tokens=[3, 2, 1], drafts=[2, 1, -1], accept=[3, 1, 1]),    # unequal drafts, one row without
    dict(tokens=[1, 1, 1], drafts=None, accept=[1, 1, 1]),          # no drafts after 3 accepted
    dict(tokens=[1, 1, 1], drafts=None, accept=[1, 1, 1]),          # and again: the conv window
    dict(tokens=[3, 3, 3], drafts=[2, 2, 2], accept=[2, 3, 1]),     # uniform drafts
    dict(tokens=[1, 3, 2], drafts=[-1, 2, 1], accept=[1, 2, 2]),    # mixed after accepted drafts
    dict(tokens=[1, 1, 1], drafts=None, accept=[1, 1, 1]),
]


@pytest.fixture(scope="module")
def ngram_config(registered, qwen35_model_dir, distributed):
    return engine_config(qwen35_model_dir, gdn_prefill_backend="flashqla",
                         speculative_config={"method": "ngram", "num_speculative_tokens": NUM_SPEC,
                                             "prompt_lookup_max": 3, "prompt_lookup_min": 2})


def _oracle_outputs(layer, weight, hist_x, hist_a, hist_b, x, a, b):
    """Float64 outputs of this step's tokens ``x`` after the accepted history, from zero state."""
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    full_x, full_a, full_b = torch.cat([hist_x, x]), torch.cat([hist_a, a]), torch.cat([hist_b, b])
    y, _ = conv_oracle(full_x, torch.zeros(full_x.shape[1], weight.shape[1] - 1), weight, False)
    L = y.shape[0]
    q, k = y[:, : H * K].reshape(L, H, K), y[:, H * K: 2 * H * K].reshape(L, H, K)
    v = y[:, 2 * H * K:].reshape(L, HV, V)
    g, beta = gdn_gate_ref(full_a, full_b, layer.A_log.detach().cpu(), layer.dt_bias.detach().cpu(), torch.float64)
    o, final, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=K**-0.5, use_qk_l2norm=True)
    return o[-x.shape[0]:], final[0]


def run_ngram_steps(config, monkeypatch, device):
    from vllm.forward_context import set_forward_context

    if device == "cpu":
        monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    gen = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    layer = build_gdn_layer(config)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0.0, 0.4, generator=gen)
        layer.A_log.uniform_(-2.0, 0.5, generator=gen)
        layer.dt_bias.uniform_(-1.0, 1.0, generator=gen)
    layer.to(device)
    conv_shape, ssm_shape = layer.get_state_shape()[:2]
    conv_dtype, ssm_dtype = layer.get_state_dtype()[:2]
    # garbage in every slot: nothing may be read before it is written
    layer.kv_cache = (torch.randn(NUM_SLOTS, *conv_shape, generator=gen).to(device, conv_dtype),
                      torch.randn(NUM_SLOTS, *ssm_shape, generator=gen).to(device, ssm_dtype))
    builder = metadata_builder(layer, config, device)
    accepted = torch.ones(8, dtype=torch.int32, device=device)  # the runner's buffer
    table = torch.randperm(NUM_SLOTS - 1, generator=gen)[: 3 * (NUM_SPEC + 1)].add(1).view(3, NUM_SPEC + 1)
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    dim = 2 * H * K + HV * V
    dt = config.model_config.dtype
    weight = layer.conv1d.weight.detach().view(layer.conv1d.weight.shape[0], -1).cpu()
    hist = [[torch.empty(0, dim, dtype=dt), torch.empty(0, HV, dtype=dt), torch.empty(0, HV, dtype=dt)]
            for _ in range(3)]
    worst = []
    for n_step, step in enumerate(STEPS):
        lens = step["tokens"]
        T = sum(lens)
        x = torch.randn(T, dim, generator=gen).to(dt)
        a, b = torch.randn(T, HV, generator=gen).to(dt), torch.randn(T, HV, generator=gen).to(dt)
        context = [h[0].shape[0] for h in hist]
        cm = common_metadata(lens, context, table.tolist(), device=device)
        if step["drafts"] is None:
            md = builder.build(0, cm)
        else:
            md = builder.build(0, cm, num_accepted_tokens=accepted[:3],
                               num_decode_draft_tokens_cpu=torch.tensor(step["drafts"], dtype=torch.int32))
        out = torch.zeros(T, HV, V, dtype=dt, device=device)
        with set_forward_context({layer.prefix: md}, config):
            layer._forward_core(mixed_qkv=x.to(device, copy=True), b=b.to(device), a=a.to(device), core_attn_out=out)
        bounds = torch.tensor([0] + lens).cumsum(0).tolist()
        for r in range(3):
            lo, hi = bounds[r], bounds[r + 1]
            ref, _ = _oracle_outputs(layer, weight, *hist[r], x[lo:hi], a[lo:hi], b[lo:hi])
            err = (out[lo:hi].double().cpu() - ref).abs().max().item() / ref.abs().max().item()
            worst.append(err)
            assert err <= 2e-2, f"step {n_step}, request {r}: output error {err:.3e} of max |o|"
        acc = step["accept"] or lens  # a prefill keeps all its tokens
        for r in range(3):
            lo = bounds[r]
            for i, t in enumerate((x, a, b)):
                hist[r][i] = torch.cat([hist[r][i], t[lo: lo + acc[r]]])
        # what the runner counts after sampling: the tokens kept of a verified row, one sampled otherwise
        accepted[:3] = torch.tensor(step["accept"] or [1, 1, 1], dtype=torch.int32)
    # the last step had no drafts: every request's state is in its column-0 slot
    ssm_state = layer.kv_cache[1]
    for r in range(3):
        h = hist[r]
        _, final = _oracle_outputs(layer, weight, h[0][:-1], h[1][:-1], h[2][:-1], h[0][-1:], h[1][-1:], h[2][-1:])
        got = ssm_state[table[r, 0]].double().cpu()
        assert (got - final).abs().max() <= 2e-2 * final.abs().max() + 1e-3, r
    return max(worst)


def test_ngram_steps_match_the_float64_oracle(ngram_config, monkeypatch):
    run_ngram_steps(ngram_config, monkeypatch, "cpu")


def test_resume_is_planned_only_after_a_step_with_drafts(ngram_config):
    """The builder plans the move of states to column 0 only on steps after drafts, for the rows
    without drafts, from the runner's buffer as it was handed on the last step with drafts."""
    layer = build_gdn_layer(ngram_config)
    builder = metadata_builder(layer, ngram_config)
    acc = torch.tensor([3, 1, 2, 1], dtype=torch.int32)
    table = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    md = builder.build(0, common_metadata([1, 1, 1], [5, 5, 5], table))
    assert md.qla_resume_src is None
    md = builder.build(0, common_metadata([3, 2, 1], [5, 5, 5], table), num_accepted_tokens=acc[:3],
                       num_decode_draft_tokens_cpu=torch.tensor([2, 1, -1], dtype=torch.int32))
    assert md.qla_resume_src is None  # the step before had no drafts
    assert md.qla_spec_keep.tolist() == [0, 1, 2, 3, 4]
    assert md.qla_spec_gather.tolist() == [0, 1, 2, 3, 4, 4]
    assert md.qla_spec_write.tolist() == [1, 2, 3, 4, 5, 0]
    assert builder.qla_accepted is acc  # the buffer, not the slice vLLM passed
    md = builder.build(0, common_metadata([1, 1, 1], [8, 7, 6], table))
    assert md.qla_resume_src.tolist() == [3, 4, 8] and md.qla_resume_dst.tolist() == [1, 4, 7]
    assert md.qla_resume_conv_cols[:, 0].tolist() == [[2, 3, 4], [0, 1, 2], [1, 2, 3]]
    md = builder.build(0, common_metadata([1, 1, 1], [9, 8, 7], table))
    assert md.qla_resume_src is None
    builder.build(0, common_metadata([3, 3, 3], [9, 8, 7], table), num_accepted_tokens=acc[:3],
                  num_decode_draft_tokens_cpu=torch.tensor([2, 2, 2], dtype=torch.int32))
    md = builder.build(0, common_metadata([1, 1, 40], [12, 10, 0], table))  # two decodes, a new prompt
    assert md.qla_resume_src.tolist() == [3, 4] and md.qla_resume_dst.tolist() == [1, 4]


def test_a_fresh_one_token_prompt_is_zeroed_not_resumed(ngram_config):
    """A new request whose whole prompt is one token runs as a decode row (vLLM splits by query
    length): after a step with drafts, its slot is zeroed in the group's layers before the step and
    it is left out of the state moves, which would copy another column's leftovers into it."""
    layer = build_gdn_layer(ngram_config)
    conv_shape, ssm_shape = layer.get_state_shape()[:2]
    layer.kv_cache = (torch.randn(NUM_SLOTS, *conv_shape), torch.randn(NUM_SLOTS, *ssm_shape))
    before = [t.clone() for t in layer.kv_cache]
    builder = metadata_builder(layer, ngram_config)
    acc = torch.tensor([3, 2, 2], dtype=torch.int32)
    table = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    builder.build(0, common_metadata([3, 3, 3], [5, 5, 5], table), num_accepted_tokens=acc[:3],
                  num_decode_draft_tokens_cpu=torch.tensor([2, 2, 2], dtype=torch.int32))
    assert all(torch.equal(t, b) for t, b in zip(layer.kv_cache, before))  # no fresh row: nothing zeroed
    # the third request finished; a new one-token prompt took its slots
    md = builder.build(0, common_metadata([1, 1, 1], [8, 7, 0], table))
    assert md.qla_resume_src.tolist() == [3, 5] and md.qla_resume_dst.tolist() == [1, 4]
    for t, b in zip(layer.kv_cache, before):
        assert not t[7].any()  # the new request's column-0 slot
        keep = [i for i in range(NUM_SLOTS) if i != 7]
        assert torch.equal(t[keep], b[keep])
    # a one-token row that is the last chunk of a longer prompt keeps its state
    layer.kv_cache[1][7].fill_(1.0)
    builder.build(0, common_metadata([1, 1, 1], [9, 8, 30], table, prefilling=[False, False, True]))
    assert bool((layer.kv_cache[1][7] == 1.0).all())


def test_accepted_counts_that_are_no_view_are_not_kept(ngram_config, caplog):
    """A vLLM that hands the builder a temporary (no view of the runner's buffer) cannot be read on
    a later step: the builder says so once and plans no state move (vLLM's own behaviour)."""
    layer = build_gdn_layer(ngram_config)
    builder = metadata_builder(layer, ngram_config)
    table = [[1, 2, 3], [4, 5, 6]]
    with caplog.at_level("WARNING", logger="vllm.qla_serving"):
        builder.build(0, common_metadata([3, 3], [5, 5], table), num_accepted_tokens=torch.tensor([2, 3]),
                      num_decode_draft_tokens_cpu=torch.tensor([2, 2], dtype=torch.int32))
    assert builder.qla_accepted is False and "not a view" in caplog.text
    assert builder.build(0, common_metadata([1, 1], [8, 8], table)).qla_resume_src is None


@pytest.mark.gpu
def test_ngram_steps_on_the_gpu(ngram_config, monkeypatch):
    run_ngram_steps(ngram_config, monkeypatch, "cuda")
