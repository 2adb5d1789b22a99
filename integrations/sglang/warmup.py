"""Start-up compilation for SGLang: which configurations a model runner will call.

Runs once per model runner, while SGLang builds its attention backends (before CUDA-graph
capture and before the first request). The loop, progress bar and failure policy are
:mod:`qla_serving.warmup`'s; this module only reads SGLang's choices into a
:class:`~qla_serving.warmup.WarmupConfig`.
"""

from __future__ import annotations

import logging

import torch

from qla_serving.warmup import WarmupConfig, device_call_steps, kernel_warmup_specs, resolve_steps, run_warmup

logger = logging.getLogger("qla_serving")


def warmup_specs(
    *,
    phases,
    num_qk_heads: int | None,
    num_v_heads: int,
    dtype: torch.dtype,
    pool_dtype: torch.dtype,
    gate_dtype: torch.dtype = torch.float32,
    bias_dtype: torch.dtype | None = None,
    index_dtype: torch.dtype = torch.int32,
    draft_tokens: int | None = None,
) -> list[tuple[str, str, str, dict]]:
    """The static configurations SGLang will call: ``(label, module, function, kwargs)``.

    Args:
        phases: subset of ``{"prefill", "decode", "verify"}`` routed to our kernels.
        num_qk_heads, num_v_heads: ``H`` and ``HV`` per rank (after tensor parallelism);
            ``num_qk_heads`` None when no GDN layer was found (nothing to compile).
        dtype: activation dtype (q/k/v, decode's a/b). SGLang's prefill gate gives float32
            beta and leaves the q/k L2 norm to the kernel.
        pool_dtype: the ``ssm_states`` pool dtype (``--mamba-ssm-dtype``).
        gate_dtype: dtype of the layers' ``A_log``; bias_dtype: of their ``dt_bias``
            (None: ``gate_dtype``).
        index_dtype: dtype of SGLang's ``cache_indices`` (int32).
        draft_tokens: speculative draft tokens per request (verify), or None.
    """
    cfg = warmup_config(phases=phases, num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, dtype=dtype,
                        pool_dtype=pool_dtype, gate_dtype=gate_dtype, bias_dtype=bias_dtype,
                        index_dtype=index_dtype, draft_tokens=draft_tokens)
    return [] if cfg is None else kernel_warmup_specs(cfg)


def warmup_config(*, phases, num_qk_heads: int | None, num_v_heads: int, dtype: torch.dtype,
                  pool_dtype: torch.dtype, gate_dtype: torch.dtype = torch.float32,
                  bias_dtype: torch.dtype | None = None, index_dtype: torch.dtype = torch.int32,
                  draft_tokens: int | None = None) -> WarmupConfig | None:
    """:func:`warmup_specs`' arguments as a :class:`~qla_serving.warmup.WarmupConfig` (None
    without head counts)."""
    if num_qk_heads is None:
        return None
    return WarmupConfig(
        num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, dtype=dtype, pool_dtype=pool_dtype,
        gate_dtype=gate_dtype, bias_dtype=bias_dtype, index_dtype=index_dtype, phases=frozenset(phases),
        prefill_beta_dtype=torch.float32, prefill_qk_l2norm=True, verify_tokens=draft_tokens,
    )


def warmup_kernels(device: torch.device | str | None = None, **config) -> int:
    """Compile every configuration of :func:`warmup_specs` with a progress bar, then, on a CUDA
    ``device``, call the ops once for real (:func:`qla_serving.warmup.device_call_steps`: the
    kernels' first launch, and a long prefill on the planner's AutoCP path, which SGLang's own
    short warm-up request does not take); return how many steps ran.

    Accepts the keyword arguments of :func:`warmup_specs`. Missing kernel modules are logged
    and compile on first use; a failing compile is logged, or raised under ``QLA_STRICT=1``.
    """
    specs = warmup_specs(**config)
    if not specs:
        if config.get("num_qk_heads") is None:
            logger.warning("qla-serving: no GDN layer found to read head counts from; kernels compile on first use")
        return 0
    steps = resolve_steps(specs, logger)
    if device is not None and torch.device(device).type == "cuda":
        steps += device_call_steps(warmup_config(**config), device)
    return len(steps) - run_warmup(steps, log=logger, device=device)


__all__ = ["warmup_config", "warmup_kernels", "warmup_specs"]
