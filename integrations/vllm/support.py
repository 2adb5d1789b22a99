"""Whether a GDN layer can run on qla-serving's kernels, and the fallback policy.

With ``flashqla`` requested, each GDN layer asks :func:`decide` once at construction. A
configuration the kernels do not support (not SM90, head dims other than 128, fp32
activations, an unsupported state dtype, TileLang missing or not the version the kernels are
built for) falls back to vLLM's default backend with ONE warning naming the reason, on vLLM's
logger; ``QLA_STRICT=1`` turns that into :class:`qla_serving.backend.KernelUnavailable`.
"""

from __future__ import annotations

import logging

import torch

from qla_serving import backend

# A child of vLLM's "vllm" logger, so the warning goes through vLLM's handlers and format.
logger = logging.getLogger("vllm.qla_serving")

_warned: set[str] = set()


def unsupported_reason(
    device: torch.device | str,
    head_k_dim: int,
    head_v_dim: int,
    activation_dtype: torch.dtype,
    state_dtype: torch.dtype,
) -> str | None:
    """Why qla-serving's kernels cannot run this GDN layer, or None when they can.

    Args:
        device: the device the layer runs on (vLLM's ``device_config.device``).
        head_k_dim, head_v_dim: the layer's key and value head dims.
        activation_dtype: the model's activation dtype.
        state_dtype: the dtype of vLLM's recurrent (ssm) state cache.
    """
    return backend.unsupported_reason(device, head_k_dim, head_v_dim, activation_dtype, state_dtype)


def decide(reason: str | None, *, what: str = "GDN layers") -> bool:
    """Apply the fallback policy to ``reason`` (from :func:`unsupported_reason`).

    Returns:
        True when the kernels run; False after warning once per reason (vLLM's default runs).

    Raises:
        qla_serving.backend.KernelUnavailable: ``reason`` is set and ``QLA_STRICT=1``.
    """
    if reason is None:
        return True
    backend.fall_back_once(
        f"qla-serving: flashqla cannot run the {what} ({reason}); falling back to vLLM's default GDN backend.",
        _warned, reason, log=logger,
        strict_message=(f"qla-serving: --linear-attn-backend flashqla cannot run the {what}: {reason}; "
                        "QLA_STRICT=1 forbids falling back to vLLM's default backend"),
    )
    return False
