"""GDN gates that remember: what the benchmarks put in place of dummy weights' gates.

Used by the offline acceptance harness (``e2e_bench/vllm_offline.py``, after the engine is built)
and by vLLM's ``qla_dummy`` load format (:mod:`qla_serving.integrations.vllm.bench_loader`), which
the serving benchmark starts ``vllm serve`` with.
"""

from __future__ import annotations

# vLLM's dummy loader fills every parameter with U(-1e-3, 1e-3): A_log ~ 0 and dt_bias ~ 0 give
# every head the decay exp(-exp(A_log) * softplus(dt_bias)) ~ 0.5 per token, so a head forgets
# its state within ~10 tokens and a wrong state carried across chunks or from the prefix cache
# would not change the outputs. The worker re-draws both the way Qwen3-Next / Mamba-2 initialise
# them: A = exp(A_log) ~ U(1, 16), softplus(dt_bias) = dt ~ log-U(1e-3, 0.1), i.e. per-token
# decays from exp(-1.6) (short memory) to exp(-1e-3) (about a thousand tokens).
GATE_A_RANGE = (1.0, 16.0)
GATE_DT_RANGE = (1e-3, 0.1)


def gdn_gate_values(num_heads: int, seed: int):
    """``(A_log, dt_bias)`` for one GDN layer: float32 CPU tensors of shape ``[num_heads]``.

    Deterministic in ``seed``, so every backend's engine gets the same gates.
    """
    import math

    import torch

    gen = torch.Generator().manual_seed(seed)
    a = GATE_A_RANGE[0] + (GATE_A_RANGE[1] - GATE_A_RANGE[0]) * torch.rand(num_heads, generator=gen, dtype=torch.float64)
    lo, hi = math.log(GATE_DT_RANGE[0]), math.log(GATE_DT_RANGE[1])
    dt = torch.exp(lo + (hi - lo) * torch.rand(num_heads, generator=gen, dtype=torch.float64))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    return torch.log(a).float(), dt_bias.float()


def init_gdn_gates(model) -> int:
    """Overwrite ``A_log`` and ``dt_bias`` of every GDN layer of ``model`` (an ``nn.Module``) in
    place with :func:`gdn_gate_values`, seeded by the module's name; returns how many layers.

    Runs inside vLLM's worker through ``LLM.apply_model`` after the engine is built (vLLM reads
    both parameters at every step; nothing is derived from them at load time).
    """
    import zlib

    import torch

    layers = 0
    seen = set()  # SGLang's GDN layer hands its A_log / dt_bias to an inner attention module too
    for name, module in model.named_modules():
        A_log, dt_bias = getattr(module, "A_log", None), getattr(module, "dt_bias", None)
        if not (isinstance(A_log, torch.nn.Parameter) and isinstance(dt_bias, torch.nn.Parameter)):
            continue
        if id(A_log) in seen:
            continue
        seen.add(id(A_log))
        if A_log.shape != dt_bias.shape or A_log.dim() != 1:
            raise ValueError(f"{name}: A_log {tuple(A_log.shape)} and dt_bias {tuple(dt_bias.shape)} "
                             "must be equal 1-D (one value per value head)")
        a, d = gdn_gate_values(A_log.numel(), zlib.crc32(name.encode()))
        with torch.no_grad():
            A_log.copy_(a.to(A_log.device, A_log.dtype))
            dt_bias.copy_(d.to(dt_bias.device, dt_bias.dtype))
        layers += 1
    return layers
