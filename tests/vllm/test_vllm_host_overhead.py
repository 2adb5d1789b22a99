"""Per-step work the builder does once for every GDN layer of a step (issue #24): a layer of a mixed
prefill + decode step (eager in vLLM's PIECEWISE graphs) maps no slots itself."""

from __future__ import annotations

import pytest
import torch
from qla_vllm_helpers import common_metadata, metadata_builder
from test_vllm_forward import fresh_layer

import qla_serving


@pytest.fixture
def layer(flashqla_config, distributed, monkeypatch):
    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    return fresh_layer(flashqla_config)[0]


def _step(layer, config, md, tokens):
    from vllm.forward_context import set_forward_context

    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    dt = config.model_config.dtype
    x = torch.randn(tokens, 2 * H * K + HV * V).to(dt)
    a, b = torch.randn(tokens, HV).to(dt), torch.randn(tokens, HV).to(dt)
    out = torch.zeros(tokens, HV, V, dtype=dt)
    with set_forward_context({layer.prefix: md}, config):
        layer._forward_core(mixed_qkv=x, b=b, a=a, core_attn_out=out)
    return out


def test_mixed_step_maps_decode_slots_once_for_every_layer(layer, flashqla_config, monkeypatch):
    from qla_serving.integrations.vllm import layer as layer_mod

    # three decodes (the second on vLLM's null block, a padded row) and a prefill
    md = metadata_builder(layer, flashqla_config).build(
        0, common_metadata([1, 1, 1, 70], [5, 9, 2, 0], [4, 0, 9, 6])
    )
    assert md.qla_decode_state_indices.tolist() == [4, -1, 9]
    assert md.qla_decode_state_indices.dtype == md.non_spec_state_indices_tensor.dtype

    def per_layer_mapping(_):
        raise AssertionError("a layer of a mixed step mapped the decode slots itself")

    monkeypatch.setattr(layer_mod, "qla_state_slots", per_layer_mapping)
    seen = []
    real = qla_serving.gated_delta_rule_decode
    monkeypatch.setattr(
        qla_serving, "gated_delta_rule_decode", lambda *a, **kw: seen.append(a[8]) or real(*a, **kw)
    )
    for _ in range(2):  # two GDN layers of the step
        out = _step(layer, flashqla_config, md, 73)
    assert len(seen) == 2 and all(s is md.qla_decode_state_indices for s in seen)
    assert not out[1].any() and out[0].any()  # the padded row is skipped: zero output


def test_pure_decode_step_maps_slots_in_the_layer(layer, flashqla_config, monkeypatch):
    """A pure decode step replays in vLLM's FULL CUDA graph: the mapping stays in the (captured)
    layer, reading vLLM's persistent index buffer, not a tensor built anew each step."""
    from qla_serving.integrations.vllm import layer as layer_mod

    md = metadata_builder(layer, flashqla_config).build(0, common_metadata([1, 1], [5, 9], [4, 0]))
    assert md.qla_decode_state_indices is None
    calls = []
    real = layer_mod.qla_state_slots
    monkeypatch.setattr(layer_mod, "qla_state_slots", lambda idx: calls.append(idx) or real(idx))
    out = _step(layer, flashqla_config, md, 2)
    assert len(calls) == 1 and not out[1].any() and out[0].any()


def test_prefill_lengths_from_host_lists_match_vllms_split(registered):
    """The builder works out the prefill rows' lengths on host lists: the same rows as vLLM's
    tensor expressions (decodes peeled off the front; with speculative rows, the non-speculative
    ones), padded offsets past num_reqs ignored."""
    import random

    from qla_serving.integrations.vllm.metadata import prefill_query_lens_cpu

    rng = random.Random(7)
    for _ in range(200):
        num_reqs = rng.randint(1, 12)
        q = [rng.choice([0, 1, 1, 3, rng.randint(1, 500)]) for _ in range(num_reqs)]
        qsl = torch.tensor(
            [0, *torch.tensor(q).cumsum(0).tolist()] + [sum(q)] * rng.randint(0, 3), dtype=torch.int32
        )
        lens = qsl[: num_reqs + 1].diff().to(torch.int64)
        num_decodes = rng.randint(0, num_reqs)
        assert prefill_query_lens_cpu(qsl, num_reqs, num_decodes, None) == lens[num_decodes:].tolist()
        mask = torch.tensor([rng.random() < 0.5 for _ in range(num_reqs + rng.randint(0, 2))])
        assert prefill_query_lens_cpu(qsl, num_reqs, 0, mask) == lens[~mask[:num_reqs]].tolist()
