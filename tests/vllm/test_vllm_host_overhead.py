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


def test_bound_launches_give_later_layers_the_kernel_arguments_of_their_own_calls(flashqla_config, distributed,
                                                                                  monkeypatch):
    """QLA_BOUND_LAUNCH: in a mixed step the second GDN layer, run on the launches the first one
    bound, passes the kernels the C arguments its own op calls pass (its conv output, gates,
    parameters, pool and output buffer; the step's slots and plan), the step's prefill workspaces
    aside, which stay the first layer's; and it calls neither op."""
    import contextlib

    from helpers import RecordingLib, recorded_kernel
    from vllm.forward_context import set_forward_context

    from qla_serving import backend
    from qla_serving.kernels import chunk_prefill, decode, library

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    layers = [fresh_layer(flashqla_config)[0] for _ in range(2)]
    md = metadata_builder(layers[0], flashqla_config).build(
        0, common_metadata([1, 1, 1, 70], [5, 9, 2, 0], [4, 0, 9, 6]))
    # the kernel path on the CPU: the ops reach the kernel entries, whose kernels record their C arguments
    monkeypatch.setattr(backend, "kernel_entry", lambda kind, loader, *args: loader())
    monkeypatch.setattr(library, "_on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(library, "_current_stream", lambda device: 0x5EED)
    for layer in layers:  # vLLM's conv as the identity: its output is the test's buffer in every run
        monkeypatch.setattr(layer, "_qla_conv_prefill", lambda x, conv_state, md: x)
        monkeypatch.setattr(layer, "_qla_conv_decode", lambda x, conv_state, md: x)
    H, HV, K, V = layers[0].num_k_heads, layers[0].num_v_heads, layers[0].head_k_dim, layers[0].head_v_dim
    dt = flashqla_config.model_config.dtype
    inputs = [(torch.randn(73, 2 * H * K + HV * V).to(dt), torch.randn(73, HV).to(dt), torch.randn(73, HV).to(dt),
               torch.zeros(73, HV, V, dtype=dt)) for _ in layers]
    ops = {"decode": 0, "prefill": 0}
    for name, attr in (("decode", "gated_delta_rule_decode"), ("prefill", "chunk_gated_delta_rule_pool_packed")):
        real = getattr(qla_serving, attr)
        monkeypatch.setattr(qla_serving, attr, (lambda n, f: lambda *a, **kw: ops.__setitem__(n, ops[n] + 1) or f(*a, **kw))(name, real))

    lib = RecordingLib()

    def calls() -> list:
        got = list(lib.calls)
        lib.calls.clear()
        return got

    def step(bound: bool) -> list:
        for layer in layers:
            layer.qla_bound_launch = bound
        md.qla_bound.clear()
        for key in ops:
            ops[key] = 0
        for layer, (x, a, b, out) in zip(layers, inputs):
            with set_forward_context({layer.prefix: md}, flashqla_config):
                layer._forward_core(mixed_qkv=x, b=b, a=a, core_attn_out=out)
        return calls()

    # probes first (the entries' arguments lay out the recording kernels' C parameters)
    seen = {}
    monkeypatch.setattr(decode, "_get_kernel", lambda key: lambda *args: seen.__setitem__("decode", args))
    monkeypatch.setattr(chunk_prefill, "_kernel_set",
                        lambda cfg: tuple((lambda n: lambda *args: seen.__setitem__(n, args))(n) for n in ("prep", "fwd")))
    step(False)
    kernels = {n: recorded_kernel(lib, n, seen[n]) for n in ("decode", "prep", "fwd")}
    monkeypatch.setattr(decode, "_get_kernel", lambda key: kernels["decode"])
    monkeypatch.setattr(chunk_prefill, "_kernel_set", lambda cfg: (kernels["prep"], kernels["fwd"]))
    own = step(False)
    assert ops == {"decode": 2, "prefill": 2} and len(own) == 6  # per layer: decode, prep, chunk_fwd
    rerun = step(True)
    assert ops == {"decode": 1, "prefill": 1} and len(rerun) == 6
    # (the prefill workspaces are allocated per op call, so they differ between the runs)
    fwd_fresh = (3, 4, 5, 12) if md.qla_plan.context_parallel is not None else (3, 4, 5)
    fresh = {1: (8, 9, 10), 2: fwd_fresh, 4: (8, 9, 10), 5: fwd_fresh}
    for i in range(6):  # the first layer runs the ops either way
        keep = [j for j in range(len(own[i])) if j not in fresh.get(i, ())]
        assert [rerun[i][j] for j in keep] == [own[i][j] for j in keep], f"call {i}"
    for i in (4, 5):
        assert [rerun[i][j] for j in fresh[i]] == [rerun[i - 3][j] for j in fresh[i]]
    # the second layer's own tensors are what it launched on
    x2, _, _, out2 = inputs[1]
    ssm2 = layers[1].kv_cache[1]
    assert x2.data_ptr() in rerun[3] and ssm2.data_ptr() in rerun[3] and layers[1].A_log.data_ptr() in rerun[3]
    assert out2.data_ptr() in rerun[3] and x2[3:].data_ptr() in rerun[4] and out2[3:].data_ptr() in rerun[5]
