"""Per-step work around the GDN kernels (issue #24): the decode rows of a step, pure or mixed, reach
the decode op as vLLM left them (its slot buffer, the packed conv output), with no mapping or
split copies in between."""

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


def _record_decode_calls(monkeypatch):
    seen = []
    real = qla_serving.gated_delta_rule_decode
    monkeypatch.setattr(qla_serving, "gated_delta_rule_decode",
                        lambda *a, **kw: seen.append((a, kw)) or real(*a, **kw))
    return seen


def _reads_in_place(args, kw, md, n):
    """The decode call got vLLM's slot buffer itself with its null block as padding, and q, k, v
    as views of one packed buffer (nothing mapped or split into new tensors per layer)."""
    q, k, v, a, b, slots = args[0], args[1], args[2], args[3], args[4], args[8]
    vllm_slots = md.non_spec_state_indices_tensor
    assert slots.data_ptr() == vllm_slots.data_ptr() and slots.shape[0] == n
    assert kw["min_slot"] == 1
    assert not q.is_contiguous() and q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.data_ptr() - q.data_ptr() == q.shape[-2] * q.shape[-1] * q.element_size()


def test_mixed_step_decodes_read_vllms_slots_in_place(layer, flashqla_config, monkeypatch):
    # three decodes (the second on vLLM's null block, a padded row) and a prefill
    md = metadata_builder(layer, flashqla_config).build(
        0, common_metadata([1, 1, 1, 70], [5, 9, 2, 0], [4, 0, 9, 6])
    )
    seen = _record_decode_calls(monkeypatch)
    for _ in range(2):  # two GDN layers of the step
        out = _step(layer, flashqla_config, md, 73)
    assert len(seen) == 2
    for args, kw in seen:
        _reads_in_place(args, kw, md, 3)
    assert not out[1].any() and out[0].any() and out[2].any()  # the padded row is skipped: zero output


def test_pure_decode_step_reads_vllms_slots_in_place(layer, flashqla_config, monkeypatch):
    """A pure decode step replays in vLLM's FULL CUDA graph: the layer adds no kernel between vLLM's
    conv update and the decode (no slot mapping, no q/k/v split copies)."""
    md = metadata_builder(layer, flashqla_config).build(0, common_metadata([1, 1], [5, 9], [4, 0]))
    seen = _record_decode_calls(monkeypatch)
    out = _step(layer, flashqla_config, md, 2)
    assert len(seen) == 1
    _reads_in_place(*seen[0], md, 2)
    assert not out[1].any() and out[0].any()


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
