"""Our layer's step on the CPU (the ops' PyTorch reference) against an independent float64 oracle.

The layer runs exactly as vLLM drives it: metadata from the (our) builder for a real
``CommonAttentionMetadata``, the forward context set, vLLM's ``_forward_core`` entry point,
vLLM's state tensors as ``kv_cache``. The oracle recomputes the causal conv, the gate and the
recurrence token by token in float64 from the inputs and the states before the step.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from qla_vllm_helpers import build_gdn_layer, common_metadata, metadata_builder

from qla_serving.ops.gated_delta_rule.naive import gdn_gate_ref, recurrent_gated_delta_rule_ref

NUM_SLOTS = 16


def fresh_layer(vllm_config, device="cpu"):
    layer = build_gdn_layer(vllm_config)
    # random weights (vLLM's dummy loader would fill them the same way)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0.0, 0.4)
        layer.A_log.uniform_(-2.0, 0.5)
        layer.dt_bias.uniform_(-1.0, 1.0)
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv_shape, ssm_shape = layer.get_state_shape()[:2]
    conv_dtype, ssm_dtype = layer.get_state_dtype()[:2]
    conv_state = torch.randn(NUM_SLOTS, *conv_shape).to(conv_dtype)
    ssm_state = (0.3 * torch.randn(NUM_SLOTS, *ssm_shape)).to(ssm_dtype)
    layer.to(device)
    layer.kv_cache = (conv_state.to(device), ssm_state.to(device))
    conv_dim_first = is_conv_state_dim_first()
    return layer, conv_dim_first


def conv_oracle(x, state, weight, has_initial):
    """Causal depthwise conv with SiLU: ``x [L, D]``, ``state [D, W-1]`` (oldest first),
    ``weight [D, W]``; returns the output and the new state, float64."""
    W = weight.shape[1]
    init = state.double().T if has_initial else torch.zeros(W - 1, x.shape[1], dtype=torch.float64)
    padded = torch.cat([init, x.double()])
    y = sum(weight[:, j].double() * padded[j: j + x.shape[0]] for j in range(W))
    return F.silu(y), padded[-(W - 1):].T


def run_step(layer, vllm_config, query, context, slots, mixed_qkv, a, b):
    from vllm.forward_context import set_forward_context

    dev = mixed_qkv.device
    md = metadata_builder(layer, vllm_config, dev).build(0, common_metadata(query, context, slots, device=dev))
    out = torch.zeros(mixed_qkv.shape[0], layer.num_v_heads, layer.head_v_dim, dtype=mixed_qkv.dtype, device=dev)
    with set_forward_context({layer.prefix: md}, vllm_config):
        layer._forward_core(mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=out)
    return out, md


@pytest.mark.parametrize("num_decodes, prefill_lens, fresh", [(0, [70], None), (3, [70, 5, 130], 1), (4, [], 2),
                                                             (2, [70, 1, 2, 130], (3, 4))])
@pytest.mark.parametrize("prefill_inputs", ["split", "packed"])
def test_step_matches_float64_oracle(flashqla_config, distributed, monkeypatch, num_decodes, prefill_lens, fresh,
                                     prefill_inputs):
    """``packed`` (the default): the prefill takes the conv output and the raw gate inputs; ``split``:
    vLLM's fused_post_conv_prep output (QLA_PREFILL_PACKED=0). ``fresh``: that one-token row is a
    new request whose prompt is one token (nothing computed before): vLLM runs it as a decode, on a
    slot holding its previous request's state, and it must start from zero like a prefill; a tuple:
    those prefill rows are new requests too (one and two tokens behind a longer prefill)."""
    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    check_step(flashqla_config, monkeypatch, "cpu", num_decodes, prefill_lens, fresh, prefill_inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("num_decodes, prefill_lens, fresh", [(3, [70, 5, 130], 1), (4, [], 2),
                                                             (2, [70, 1, 2, 130], (3, 4))])
def test_step_on_the_gpu_matches_float64_oracle(flashqla_config, distributed, monkeypatch, num_decodes,
                                                prefill_lens, fresh):
    """The same step through our kernels and vLLM's Triton conv, a fresh one-token prompt among the
    decode rows (its slot zeroed by the builder before the decode kernel reads it); or fresh prompts
    of one and two tokens behind a longer prefill, where vLLM's batch order puts a new request
    (after every row with context), so that the GDN split makes them prefill rows."""
    check_step(flashqla_config, monkeypatch, "cuda", num_decodes, prefill_lens, fresh, "packed")


def check_step(flashqla_config, monkeypatch, device, num_decodes, prefill_lens, fresh, prefill_inputs):
    monkeypatch.setenv("QLA_PREFILL_PACKED", "1" if prefill_inputs == "packed" else "0")
    if prefill_inputs == "packed":
        import qla_serving

        calls = []
        real = qla_serving.chunk_gated_delta_rule_pool_packed
        monkeypatch.setattr(qla_serving, "chunk_gated_delta_rule_pool_packed",
                            lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    rng = random.Random(torch.initial_seed())
    layer, conv_dim_first = fresh_layer(flashqla_config, device)
    conv_state, ssm_state = layer.kv_cache
    query = [1] * num_decodes + prefill_lens
    context = [rng.randint(1, 400) for _ in range(num_decodes)] + [
        rng.choice([0, rng.randint(1, 400)]) for _ in prefill_lens]
    for row in (fresh,) if isinstance(fresh, int) else fresh or ():
        context[row] = 0
    slots = rng.sample(range(1, NUM_SLOTS), len(query))
    T = sum(query)
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    dt = flashqla_config.model_config.dtype
    mixed_qkv = torch.randn(T, 2 * H * K + HV * V).to(dt)
    a, b = torch.randn(T, HV).to(dt), torch.randn(T, HV).to(dt)
    conv_before, ssm_before = conv_state.cpu().clone(), ssm_state.cpu().clone()

    out, _ = run_step(layer, flashqla_config, query, context, slots, *(t.to(device) for t in (mixed_qkv, a, b)))
    out, conv_state, ssm_state = out.cpu(), conv_state.cpu(), ssm_state.cpu()

    # --- oracle, sequence by sequence
    weight = layer.conv1d.weight.detach().cpu().view(layer.conv1d.weight.shape[0], -1)
    conv_view = conv_before if conv_dim_first else conv_before.transpose(-1, -2)
    ys, new_conv = [], []
    bounds = torch.tensor([0] + query).cumsum(0).tolist()
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        y, st = conv_oracle(mixed_qkv[s:e], conv_view[slots[i]], weight, context[i] > 0)
        ys.append(y)
        new_conv.append(st)
    y = torch.cat(ys)
    q = y[:, : H * K].reshape(T, H, K)
    k = y[:, H * K: 2 * H * K].reshape(T, H, K)
    v = y[:, 2 * H * K:].reshape(T, HV, V)
    g, beta = gdn_gate_ref(a, b, layer.A_log.detach().cpu(), layer.dt_bias.detach().cpu(), torch.float64)
    init = torch.stack([ssm_before[s].double() if c > 0 else torch.zeros(HV, V, K, dtype=torch.float64)
                        for s, c in zip(slots, context)])
    o_ref, final_ref, _ = recurrent_gated_delta_rule_ref(
        q, k, v, g, beta, scale=K**-0.5, initial_state=init, cu_seqlens=torch.tensor(bounds),
        use_qk_l2norm=True)

    # bf16 activations (the conv runs in bf16, q/k/v are bf16): errors of a few bf16 ulps
    scale = o_ref.abs().max().item()
    err = (out.double() - o_ref).abs().max().item()
    assert err <= 2e-2 * scale, f"output error {err:.3e} vs max |o| {scale:.3e}"
    for i, s in enumerate(slots):
        st_err = (ssm_state[s].double() - final_ref[i]).abs().max().item()
        assert st_err <= 2e-2 * final_ref[i].abs().max().item() + 1e-3, (i, st_err)
        got_conv = conv_state[s] if conv_dim_first else conv_state[s].transpose(-1, -2)
        # the conv state holds raw inputs: exact
        assert torch.equal(got_conv.double(), new_conv[i]), i
    # slots outside the batch are not touched, bit for bit
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(ssm_state[others], ssm_before[others])
    assert torch.equal(conv_state[others], conv_before[others])
    if prefill_inputs == "packed":  # the prefill rows went to the packed op, as one conv output
        assert calls == ([(sum(prefill_lens), 2 * H * K + HV * V)] if prefill_lens else [])
    return slots


@pytest.mark.parametrize("on_decode", [False, True])
def test_new_one_token_rows_behind_a_prefill_can_run_on_the_decode_op(flashqla_config, distributed, monkeypatch,
                                                                      on_decode):
    """QLA_FRESH_ON_DECODE=1: a new one-token prompt that vLLM's split made a prefill row (behind a
    70-token prefill) runs again on the decode op from the zero state after the prefill, as it would
    alone; the step still matches the float64 oracle. A new two-token prompt stays a prefill."""
    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    check_fresh_rows_on_decode(flashqla_config, monkeypatch, "cpu", on_decode)


@pytest.mark.gpu
def test_new_one_token_rows_behind_a_prefill_on_the_decode_kernel_on_the_gpu(flashqla_config, distributed,
                                                                             monkeypatch):
    """The same through our kernels and vLLM's Triton conv."""
    check_fresh_rows_on_decode(flashqla_config, monkeypatch, "cuda", True)


def check_fresh_rows_on_decode(flashqla_config, monkeypatch, device, on_decode):
    import qla_serving

    monkeypatch.setenv("QLA_FRESH_ON_DECODE", "1" if on_decode else "0")
    decoded = []  # the slots of each decode op call
    real = qla_serving.gated_delta_rule_decode
    monkeypatch.setattr(qla_serving, "gated_delta_rule_decode",
                        lambda *a, **k: decoded.append(a[8].tolist()) or real(*a, **k))
    slots = check_step(flashqla_config, monkeypatch, device, 2, [70, 1, 2, 130], (3, 4), "packed")
    assert decoded == ([slots[:2], [slots[3]]] if on_decode else [slots[:2]]), (decoded, slots)


def test_decode_continues_a_prefill(flashqla_config, distributed, monkeypatch):
    """Prefill 37 tokens, then decode 3 steps one token at a time: the same output and state as
    one 40-token sequence through the oracle (the state carried in vLLM's tensors in place)."""
    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    layer, _ = fresh_layer(flashqla_config)
    _, ssm_state = layer.kv_cache
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    dt = flashqla_config.model_config.dtype
    L, steps, slot = 37, 3, 5
    x = torch.randn(L + steps, 2 * H * K + HV * V).to(dt)
    a, b = torch.randn(L + steps, HV).to(dt), torch.randn(L + steps, HV).to(dt)
    outs = [run_step(layer, flashqla_config, [L], [0], [slot], x[:L], a[:L], b[:L])[0]]
    for t in range(L, L + steps):
        outs.append(run_step(layer, flashqla_config, [1], [t], [slot], x[t:t + 1], a[t:t + 1], b[t:t + 1])[0])
    out = torch.cat(outs)

    weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], -1)
    y, _ = conv_oracle(x, torch.zeros(x.shape[1], weight.shape[1] - 1), weight, False)
    q, k = y[:, : H * K].reshape(-1, H, K), y[:, H * K: 2 * H * K].reshape(-1, H, K)
    v = y[:, 2 * H * K:].reshape(-1, HV, V)
    g, beta = gdn_gate_ref(a, b, layer.A_log, layer.dt_bias, torch.float64)
    o_ref, final_ref, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=K**-0.5, use_qk_l2norm=True)
    scale = o_ref.abs().max().item()
    assert (out.double() - o_ref).abs().max().item() <= 2e-2 * scale
    assert (ssm_state[slot].double() - final_ref[0]).abs().max().item() <= 2e-2 * final_ref.abs().max().item()


def test_speculative_verify_reads_the_accepted_slot_and_fills_every_position(flashqla_config, distributed,
                                                                             monkeypatch):
    """vLLM's speculative layout: row i resumes from slot ``spec_state_indices[i, accepted_i - 1]``
    and the state after draft token t goes to ``spec_state_indices[i, t]``. The conv of this path
    is vLLM's CUDA kernel, so the recurrence is driven directly with vLLM's metadata class."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from qla_serving.ops.gated_delta_rule.naive import recurrent_decode_ref

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    layer, _ = fresh_layer(flashqla_config)
    _, ssm_state = layer.kv_cache
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    rows, T = 3, 3
    gen = torch.Generator().manual_seed(torch.initial_seed() % 2**31)
    slots = torch.randperm(NUM_SLOTS - 1, generator=gen)[: rows * T].add(1).view(rows, T).to(torch.int32)
    accepted = torch.randint(1, T + 1, (rows,), generator=gen, dtype=torch.int32)
    dt = flashqla_config.model_config.dtype
    x = torch.randn(rows * T, 2 * H * K + HV * V, generator=gen).to(dt)
    a, b = torch.randn(rows * T, HV, generator=gen).to(dt), torch.randn(rows * T, HV, generator=gen).to(dt)
    md = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=rows,
        num_spec_decode_tokens=rows * T, num_actual_tokens=rows * T, spec_state_indices_tensor=slots,
        num_accepted_tokens=accepted, spec_sequence_masks=torch.ones(rows, dtype=torch.bool))
    before = ssm_state.clone()

    o = layer._qla_spec_decode(x, a, b, ssm_state, md)

    q = x[:, : H * K].reshape(rows, T, H, K)
    k = x[:, H * K: 2 * H * K].reshape(rows, T, H, K)
    v = x[:, 2 * H * K:].reshape(rows, T, HV, V)
    init = before[slots[torch.arange(rows), accepted.long() - 1].long()]
    o_ref, states_ref = recurrent_decode_ref(q, k, v, a.view(rows, T, HV), b.view(rows, T, HV), layer.A_log,
                                             layer.dt_bias, init, scale=K**-0.5, use_qk_l2norm=True)
    assert (o.double() - o_ref.reshape(rows * T, HV, V)).abs().max() <= 2e-2 * o_ref.abs().max()
    for i in range(rows):
        for t in range(T):
            got = ssm_state[slots[i, t]].double()
            assert (got - states_ref[i, t]).abs().max() <= 2e-2 * states_ref[i, t].abs().max() + 1e-3, (i, t)
    others = [s for s in range(NUM_SLOTS) if s not in slots.flatten().tolist()]
    assert torch.equal(ssm_state[others], before[others])


def test_the_benchmark_fault_swaps_two_decode_rows_states(flashqla_config, distributed, monkeypatch):
    """QLA_BENCH_FAULT=swap-decode-slots (the stress harness's positive control): in a decode step of
    two requests each one's recurrence runs on the other's state slot; a request alone is
    unaffected. (The two slots' conv windows are made equal, so the faulted step must equal the
    correct step with the slots given the other way round, bit for bit.)"""
    from qla_serving.bench import faults
    from qla_serving.integrations.vllm.layer import QlaGatedDeltaNetAttention

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    monkeypatch.setattr(QlaGatedDeltaNetAttention, "_qla_decode", QlaGatedDeltaNetAttention._qla_decode)
    monkeypatch.setattr(QlaGatedDeltaNetAttention, "_qla_fault", None, raising=False)
    layer, _ = fresh_layer(flashqla_config)
    conv_state, ssm_state = layer.kv_cache
    conv_state[7] = conv_state[3]
    before = tuple(t.clone() for t in layer.kv_cache)
    H, HV, K, V = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    dt = flashqla_config.model_config.dtype
    x = torch.randn(2, 2 * H * K + HV * V).to(dt)
    a, b = torch.randn(2, HV).to(dt), torch.randn(2, HV).to(dt)

    def step(slots):
        for t, saved in zip(layer.kv_cache, before):
            t.copy_(saved)
        n = len(slots)
        out, _ = run_step(layer, flashqla_config, [1] * n, [9] * n, slots, x[:n].clone(), a[:n], b[:n])
        return out, ssm_state.clone()

    right, right_states = step([3, 7])
    right_swapped, swapped_states = step([7, 3])
    right_alone, alone_states = step([3])
    faults.install_vllm_fault("swap-decode-slots")
    faulty, faulty_states = step([3, 7])
    assert torch.equal(faulty, right_swapped) and torch.equal(faulty_states, swapped_states)
    assert not torch.equal(faulty, right)
    faulty_alone, faulty_alone_states = step([3])
    assert torch.equal(faulty_alone, right_alone) and torch.equal(faulty_alone_states, alone_states)
