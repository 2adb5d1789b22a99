"""Start-up compilation of the kernels a model needs, before vLLM reports ready.

vLLM runs a profiling forward pass (without attention metadata) before it allocates the KV
cache and starts serving; each GDN layer's ``_forward_core`` sees that pass first. The layer
hands it to :func:`warm_up_layer`, which compiles every kernel variant the layer's static
configuration (head counts, dtypes, state dtype, speculative tokens) will use, once per
process and configuration, with a progress bar. TileLang keeps compiled kernels in its disk
cache, so a warm restart loads instead of compiling.

Two kinds of step: the kernel modules' own ``warmup(...)`` (compiles every tile variant), and
one real call of each op with the layer's exact dtypes (covers anything the first missed: the
kernels' first launch, and for prefill a sequence long enough for the planner's AutoCP path).
The loop, progress bar and failure policy are :mod:`qla_serving.warmup`'s: a missing kernel
module or ``warmup`` is logged, not fatal (the ops then compile on first use), and
``QLA_STRICT=1`` makes a failed step an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qla_serving import backend
from qla_serving.warmup import WarmupConfig, device_call_steps, kernel_warmup_specs, resolve_steps, run_warmup

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


def warmup_config(num_qk_heads: int, num_v_heads: int, dtype: torch.dtype, state_dtype: torch.dtype,
                  gate_dtype: torch.dtype, bias_dtype: torch.dtype, num_spec_tokens: int) -> WarmupConfig:
    """A layer's :class:`~qla_serving.warmup.WarmupConfig`.

    The prefill takes vLLM's conv output and gate inputs (the packed-inputs kernels); with
    ``QLA_PREFILL_PACKED=0``, vLLM's fused_post_conv_prep output instead (L2-normalised q/k,
    float32 beta).
    """
    return WarmupConfig(
        num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, dtype=dtype, pool_dtype=state_dtype,
        gate_dtype=gate_dtype, bias_dtype=bias_dtype, prefill_beta_dtype=torch.float32, prefill_qk_l2norm=False,
        verify_tokens=num_spec_tokens + 1 if num_spec_tokens else None, prefill_packed=backend.packed_prefill(),
    )


def kernel_specs(num_qk_heads: int, num_v_heads: int, dtype: torch.dtype, state_dtype: torch.dtype,
                 gate_dtype: torch.dtype, bias_dtype: torch.dtype, num_spec_tokens: int) -> list:
    """The kernel modules' warm-up calls of a layer (:func:`qla_serving.warmup.kernel_warmup_specs`)."""
    return kernel_warmup_specs(warmup_config(num_qk_heads, num_v_heads, dtype, state_dtype, gate_dtype, bias_dtype,
                                             num_spec_tokens))


def warmup_steps(cfg: StaticConfig, A_log: torch.Tensor, dt_bias: torch.Tensor) -> list[tuple[str, object]]:
    """The ``(description, callable)`` steps that compile ``cfg``'s kernels, then call each op once
    for real (:func:`qla_serving.warmup.device_call_steps`: a long prefill on the planner's AutoCP
    path, a decode step, a speculative verify)."""
    config = warmup_config(cfg.num_qk_heads, cfg.num_v_heads, cfg.dtype, cfg.state_dtype, cfg.gate_dtype,
                           cfg.bias_dtype, cfg.num_spec_tokens)
    steps = resolve_steps(kernel_warmup_specs(config), logger)
    return steps + device_call_steps(config, cfg.device, A_log=A_log, dt_bias=dt_bias)


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
    run_warmup(warmup_steps(cfg, layer.A_log, layer.dt_bias), desc=f"qla-serving: preparing GDN kernels ({label})",
               log=logger, device=sample.device)
