"""The shared start-up compile loop: specs per phase, tolerant of missing modules, strict on failures."""

import logging

import pytest
import torch

from qla_serving import warmup
from qla_serving.backend import KernelUnavailable


def _cfg(**over):
    return warmup.WarmupConfig(**{**dict(num_qk_heads=2, num_v_heads=8, dtype=torch.bfloat16,
                                         pool_dtype=torch.float32), **over})


def test_specs_follow_the_phases_and_the_kernel_warmup_signatures():
    import inspect

    from qla_serving.kernels import chunk_prefill, decode

    specs = warmup.kernel_warmup_specs(_cfg(verify_tokens=4, prefill_qk_l2norm=False))
    assert [s[0] for s in specs] == ["prefill", "decode", "verify T=4"]
    for label, module, function, kwargs in specs:
        fn = {"prefill": chunk_prefill.warmup}.get(label, decode.warmup)
        inspect.signature(fn).bind(**kwargs)  # the kwargs fit the real kernel warm-up functions
    assert specs[0][3]["use_qk_l2norm"] is False and specs[0][3]["beta_dtype"] == torch.float32
    assert specs[2][3]["intermediate_states"] and not specs[2][3]["inplace_final_state"]
    assert [s[0] for s in warmup.kernel_warmup_specs(_cfg(phases=frozenset({"decode"}), verify_tokens=4))] == ["decode"]
    assert [s[0] for s in warmup.kernel_warmup_specs(_cfg(verify_tokens=1))] == ["prefill", "decode"]
    assert specs[0][3]["packed_gate_dtypes"] is None


def test_packed_prefill_warms_the_packed_kernels(monkeypatch):
    """With the packed prefill the warm-up loads the packed-inputs kernels, keyed on the layer's
    A_log and dt_bias dtypes (a different set would compile on the first request)."""
    from qla_serving.kernels import chunk_prefill

    spec = warmup.kernel_warmup_specs(_cfg(prefill_packed=True, bias_dtype=torch.bfloat16))[0]
    assert spec[3]["packed_gate_dtypes"] == (torch.float32, torch.bfloat16)
    seen = []
    monkeypatch.setattr(chunk_prefill, "_kernel_set", seen.append)
    chunk_prefill.warmup(**spec[3])
    assert seen == [chunk_prefill.PrefillStaticConfig(2, 8, "bfloat16", "float32", "float32", True,
                                                      ("float32", "bfloat16"))]


@pytest.mark.parametrize("value, packed", [(None, True), ("1", True), ("on", True), ("0", False), ("off", False)])
def test_packed_prefill_is_the_default_and_zero_turns_it_off(monkeypatch, value, packed):
    from qla_serving import backend

    if value is None:
        monkeypatch.delenv("QLA_PREFILL_PACKED", raising=False)
    else:
        monkeypatch.setenv("QLA_PREFILL_PACKED", value)
    assert backend.packed_prefill() is packed


calls = []


def fake_warmup(**kwargs):
    calls.append(kwargs)


def test_missing_modules_are_logged_and_skipped(caplog):
    calls.clear()
    specs = [("a", __name__, "fake_warmup", {"x": 1}), ("b", "qla_serving", "no_such_warmup", {}),
             ("c", "qla_serving.no_such_module", "warmup", {})]
    with caplog.at_level(logging.WARNING, logger="qla_serving"):
        steps = warmup.resolve_steps(specs)
    assert [label for label, _ in steps] == ["a"]
    assert warmup.run_warmup(steps) == 0 and calls == [{"x": 1}]
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "qla_serving has no no_such_warmup()" in messages
    assert "qla_serving.no_such_module does not import" in messages


def test_failed_step_counts_or_raises_in_strict(monkeypatch):
    done = []

    def boom():
        raise RuntimeError("compiler exploded")

    steps = [("ok", lambda: done.append(1)), ("boom", boom), ("ok again", lambda: done.append(2))]
    monkeypatch.delenv("QLA_STRICT", raising=False)
    assert warmup.run_warmup(steps) == 1 and done == [1, 2]
    monkeypatch.setenv("QLA_STRICT", "1")
    with pytest.raises(KernelUnavailable, match="compiler exploded"):
        warmup.run_warmup(steps)


def test_warm_up_reports_clean_steps(monkeypatch):
    calls.clear()
    monkeypatch.setattr(warmup, "kernel_warmup_specs", lambda cfg: [("a", __name__, "fake_warmup", {"cfg": cfg})])
    assert warmup.warm_up(_cfg()) == 1
    assert calls and calls[0]["cfg"].num_v_heads == 8


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_decode_warmup_covers_the_key_a_real_call_uses(monkeypatch, bias_dtype):
    """Start-up must compile exactly what serving will ask for, or the first request compiles."""
    from qla_serving.kernels import decode

    keys = []
    monkeypatch.setattr(decode, "_get_kernel", lambda key: keys.append(key) or (lambda *args: None))
    cfg = _cfg(num_qk_heads=2, num_v_heads=4, gate_dtype=torch.float32, bias_dtype=bias_dtype, verify_tokens=3)
    for _, module, _, kwargs in warmup.kernel_warmup_specs(cfg):
        if module.endswith(".decode"):
            decode.warmup(**kwargs)
    warm = set(keys)

    def call_key(N, T, verify):
        keys.clear()
        q, k = (torch.randn(N, T, 2, 128, dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(N, T, 4, 128, dtype=torch.bfloat16)
        a, b = (torch.randn(N, T, 4, dtype=torch.bfloat16) for _ in range(2))
        decode.gated_delta_rule_decode_fwd(
            q, k, v, a, b, torch.zeros(4), torch.zeros(4, dtype=bias_dtype),
            state_pool=torch.zeros(8, 4, 128, 128), state_indices=torch.arange(N, dtype=torch.int32), scale=0.1,
            use_qk_l2norm=True, out=torch.empty(N, T, 4, 128, dtype=torch.bfloat16),
            intermediate_states=torch.empty(N, T, 4, 128, 128) if verify else None, inplace_final_state=not verify)
        return keys[0]

    for N in (1, 8, 64):  # small and large batches use different tiles
        assert call_key(N, 1, verify=False) in warm
        assert call_key(N, 3, verify=True) in warm
    if bias_dtype != torch.float32:  # one dtype for both gate parameters would miss the call
        keys.clear()
        decode.warmup(2, 4, 1, dtype=torch.bfloat16, pool_dtype=torch.float32, gate_dtype=torch.float32)
        one_gate_dtype = set(keys)
        assert call_key(8, 1, verify=False) not in one_gate_dtype


def test_device_calls_take_the_long_sequence_path_of_the_first_long_request(monkeypatch):
    """The first long prefill of a served model (one 8192-token sequence, 32 value heads, 132 SMs) is
    planned as AutoCP segments: several work items per sequence, the start-state snapshot, workspaces
    for its chunks. The start-up calls must take that path (a short prefill does not), and launch the
    decode kernel, so the first request launches nothing for the first time."""
    from qla_serving.kernels import chunk_prefill, decode

    from qla_serving import backend, plan

    monkeypatch.setattr(backend, "device_unsupported_reason", lambda device: None)  # the SM90 decision
    monkeypatch.setattr(plan, "_sm_count", lambda device: 132)  # an H100's SMs
    plans, decodes = [], []
    monkeypatch.setattr(chunk_prefill, "chunk_gated_delta_rule_fwd", lambda *a, plan, **kw: plans.append(plan))
    monkeypatch.setattr(decode, "gated_delta_rule_decode_fwd", lambda *a, **kw: decodes.append(a[0].shape))
    cfg = _cfg(num_qk_heads=16, num_v_heads=32, verify_tokens=3)
    steps = warmup.device_call_steps(cfg, "cpu")
    assert [label for label, _ in steps] == ["long prefill call", "decode call", "speculative-verify call"]
    for _, fn in steps:
        fn()
    (warm,) = plans
    serving = plan.plan_prefill([0, 8192], num_v_heads=32)
    assert serving.context_parallel is not None  # the finding's request is split ...
    assert warm.num_seqs == 1 and warm.context_parallel is not None and warm.work_items_cpu.shape[0] > 1  # ... so is this
    assert len(decodes) == 2
    assert [label for label, _ in warmup.device_call_steps(_cfg(phases=frozenset({"decode"})), "cpu")] == ["decode call"]


@pytest.mark.parametrize("over", [
    dict(num_qk_heads=16, num_v_heads=32, pool_dtype=torch.bfloat16, verify_tokens=4,
         prefill_beta_dtype=torch.float32, prefill_qk_l2norm=True),  # SGLang's calls
    dict(num_qk_heads=16, num_v_heads=64, pool_dtype=torch.float32, gate_dtype=torch.float32,
         bias_dtype=torch.bfloat16, prefill_qk_l2norm=False),
    dict(num_qk_heads=16, num_v_heads=32, pool_dtype=torch.float32, gate_dtype=torch.float32,
         bias_dtype=torch.bfloat16, prefill_packed=True),  # vLLM's by default
])
def test_device_calls_ask_for_no_kernel_the_warmup_did_not(monkeypatch, over):
    """The start-up device calls launch kernels the warm-up resolved: under QLA_STRICT=1 with the
    engine's own TileLang (no compiler), a call that asked for another configuration would fail
    the server's start."""
    from qla_serving import backend, plan
    from qla_serving.kernels import chunk_prefill, decode

    monkeypatch.setattr(backend, "device_unsupported_reason", lambda device: None)
    monkeypatch.setattr(plan, "_sm_count", lambda device: 132)
    keys = []
    monkeypatch.setattr(decode, "_get_kernel", lambda key: keys.append(key) or (lambda *args: None))
    monkeypatch.setattr(chunk_prefill, "_kernel_set",
                        lambda cfg: keys.append(cfg) or (lambda *args: None, lambda *args: None))
    cfg = _cfg(**over)
    for _, module, function, kwargs in warmup.kernel_warmup_specs(cfg):
        getattr(chunk_prefill if module.endswith(".chunk_prefill") else decode, function)(**kwargs)
    warm = set(keys)
    keys.clear()
    steps = warmup.device_call_steps(cfg, "cpu")
    for _, fn in steps:
        fn()
    assert len(keys) == len(steps) and set(keys) <= warm
