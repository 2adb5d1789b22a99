"""Start-up compilation of the kernels a model needs, before vLLM reports ready.

vLLM runs a profiling forward pass (without attention metadata) before it allocates the KV
cache and starts serving; each GDN layer's ``_forward_core`` sees that pass first. The layer
hands it to :func:`warm_up_layer`, which compiles every kernel variant the layer's static
configuration (head counts, dtypes, state dtype, speculative tokens) will use, once per
process and configuration, with a progress bar. TileLang keeps compiled kernels in its disk
cache, so a warm restart loads instead of compiling.

Two kinds of step: the kernel modules' own ``warmup(...)`` (compiles every tile variant), and
one tiny real call of each op with the layer's exact dtypes (covers anything the first
missed). The loop, progress bar and failure policy are :mod:`qla_serving.warmup`'s: a missing
kernel module or ``warmup`` is logged, not fatal (the ops then compile on first use), and
``QLA_STRICT=1`` makes a failed step an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import qla_serving
from qla_serving.constants import CHUNK_SIZE
from qla_serving.plan import plan_prefill
from qla_serving.warmup import WarmupConfig, kernel_warmup_specs, resolve_steps, run_warmup

logger = logging.getLogger("vllm.qla_serving")

_done: set[StaticConfig] = set()


@dataclass(frozen=True)
class StaticConfig:
    """Everything a GDN layer's kernels are compiled for (the runtime sizes are not here)."""

    device: str
    num_qk_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    dtype: torch.dtype
    state_dtype: torch.dtype
    gate_dtype: torch.dtype
    bias_dtype: torch.dtype
    num_spec_tokens: int


def layer_static_config(layer, device: torch.device) -> StaticConfig:
    """The :class:`StaticConfig` of a (qla-serving) vLLM GDN layer on ``device``."""
    _, state_dtype = layer.get_state_dtype()
    return StaticConfig(
        device=str(device), num_qk_heads=layer.num_k_heads // layer.tp_size,
        num_v_heads=layer.num_v_heads // layer.tp_size, head_k_dim=layer.head_k_dim,
        head_v_dim=layer.head_v_dim, dtype=layer.model_config.dtype, state_dtype=state_dtype,
        gate_dtype=layer.A_log.dtype, bias_dtype=layer.dt_bias.dtype, num_spec_tokens=layer.num_spec,
    )


def kernel_specs(num_qk_heads: int, num_v_heads: int, dtype: torch.dtype, state_dtype: torch.dtype,
                 gate_dtype: torch.dtype, bias_dtype: torch.dtype, num_spec_tokens: int) -> list:
    """The kernel modules' warm-up calls of a layer (:func:`qla_serving.warmup.kernel_warmup_specs`).

    vLLM's fused_post_conv_prep hands the prefill L2-normalised q/k and float32 beta.
    """
    return kernel_warmup_specs(WarmupConfig(
        num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, dtype=dtype, pool_dtype=state_dtype,
        gate_dtype=gate_dtype, bias_dtype=bias_dtype, prefill_beta_dtype=torch.float32, prefill_qk_l2norm=False,
        verify_tokens=num_spec_tokens + 1 if num_spec_tokens else None,
    ))


def warmup_steps(cfg: StaticConfig, A_log: torch.Tensor, dt_bias: torch.Tensor) -> list[tuple[str, object]]:
    """The ``(description, callable)`` steps that compile ``cfg``'s kernels."""
    H, HV, K, V = cfg.num_qk_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    dev = torch.device(cfg.device)
    steps = resolve_steps(kernel_specs(H, HV, cfg.dtype, cfg.state_dtype, cfg.gate_dtype, cfg.bias_dtype,
                                       cfg.num_spec_tokens), logger)

    def pool():
        return torch.zeros(2, HV, V, K, dtype=cfg.state_dtype, device=dev)

    def unit(*shape):
        # Deterministic inputs (no RNG: vLLM's seeded sampling must not notice the warm-up).
        return torch.full(shape, K**-0.5, dtype=cfg.dtype, device=dev)

    def prefill_call():
        T = CHUNK_SIZE  # one full chunk
        qla_serving.chunk_gated_delta_rule_pool(
            unit(T, H, K), unit(T, H, K), unit(T, HV, V), torch.full((T, HV), -0.1, device=dev),
            torch.full((T, HV), 0.5, device=dev), pool(), torch.zeros(1, dtype=torch.int32, device=dev),
            has_initial_state=torch.ones(1, dtype=torch.bool, device=dev), scale=K**-0.5,
            use_qk_l2norm_in_kernel=False, plan=plan_prefill([0, T], device=dev))

    def decode_call(T: int):
        shape = (1, T) if T > 1 else (1,)
        qla_serving.gated_delta_rule_decode(
            unit(*shape, H, K), unit(*shape, H, K), unit(*shape, HV, V), unit(*shape, HV), unit(*shape, HV),
            A_log, dt_bias, pool(), torch.zeros(1, dtype=torch.int32, device=dev), scale=K**-0.5,
            use_qk_l2norm_in_kernel=True,
            intermediate_states=(torch.empty(1, T, HV, V, K, dtype=cfg.state_dtype, device=dev) if T > 1 else None),
            inplace_final_state=T == 1)

    steps.append(("prefill call", prefill_call))
    steps.append(("decode call", lambda: decode_call(1)))
    if cfg.num_spec_tokens:
        steps.append(("speculative-verify call", lambda: decode_call(cfg.num_spec_tokens + 1)))
    return steps


def warm_up_layer(layer, sample: torch.Tensor) -> None:
    """Compile the kernels ``layer`` needs, once per process and static configuration.

    Args:
        layer: a :class:`~qla_serving.integrations.vllm.layer.QlaGatedDeltaNetAttention`.
        sample: any tensor of the profiling pass (gives the device).
    """
    if sample.device.type != "cuda":
        return  # the reference path compiles nothing
    cfg = layer_static_config(layer, sample.device)
    if cfg in _done:
        return
    _done.add(cfg)
    label = f"H={cfg.num_qk_heads} HV={cfg.num_v_heads} {str(cfg.dtype).replace('torch.', '')}"
    steps = warmup_steps(cfg, layer.A_log, layer.dt_bias)
    with torch.no_grad():
        run_warmup(steps, desc=f"qla-serving: compiling GDN kernels ({label})", log=logger)
    torch.cuda.synchronize(sample.device)
