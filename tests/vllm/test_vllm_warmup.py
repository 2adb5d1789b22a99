"""The vLLM start-up compile hook (the shared loop itself is tested in tests/test_warmup.py)."""

from __future__ import annotations

import logging

import torch



def test_steps_of_a_static_config_cover_prefill_decode_and_spec():
    from qla_serving.integrations.vllm import warmup

    cfg = warmup.StaticConfig(device="cpu", num_qk_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128,
                              dtype=torch.bfloat16, state_dtype=torch.float32, gate_dtype=torch.float32,
                              bias_dtype=torch.bfloat16, num_spec_tokens=2)
    names = [name for name, _ in warmup.warmup_steps(cfg, torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))]
    assert {"long prefill call", "decode call", "speculative-verify call"} <= set(names)
    no_spec = warmup.StaticConfig(**{**cfg.__dict__, "num_spec_tokens": 0})
    assert "speculative-verify call" not in [n for n, _ in warmup.warmup_steps(no_spec, torch.zeros(4), torch.zeros(4))]


def test_missing_kernel_module_is_logged_on_vllms_logger(monkeypatch):
    """The shared warm-up loop reports through the adapter's logger (a child of vLLM's)."""
    from qla_serving.integrations.vllm import warmup
    from qla_serving.warmup import resolve_steps

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("vllm.qla_serving").addHandler(handler)
    try:
        assert resolve_steps([("x", "qla_serving.kernels.no_such_kernel_module", "warmup", {})], warmup.logger) == []
    finally:
        logging.getLogger("vllm.qla_serving").removeHandler(handler)
    assert any("no_such_kernel_module" in m for m in seen)


def test_profile_run_on_cpu_compiles_nothing(flashqla_config, distributed, monkeypatch):
    """vLLM's profiling pass (no metadata) reaches our hook; on the CPU it has nothing to build."""
    from qla_serving.integrations.vllm import warmup
    from qla_vllm_helpers import build_gdn_layer
    from vllm.forward_context import set_forward_context

    monkeypatch.setenv("QLA_FORCE_REFERENCE", "1")
    layer = build_gdn_layer(flashqla_config)
    out = torch.zeros(8, layer.num_v_heads, layer.head_v_dim, dtype=torch.bfloat16)
    qkv = torch.randn(8, 2 * 2 * 128 + 4 * 128).to(torch.bfloat16)
    before = set(warmup._done)
    with set_forward_context(None, flashqla_config):
        layer._forward_core(mixed_qkv=qkv, b=torch.zeros(8, 4), a=torch.zeros(8, 4), core_attn_out=out)
    assert warmup._done == before and not out.any()
