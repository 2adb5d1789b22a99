"""Whether a GDN layer can run on qla-serving's kernels, and the fallback policy.

With ``flashqla`` requested, each GDN layer asks :func:`decide` once at construction. A
configuration the kernels do not support (not SM90, head dims other than 128, fp32
activations, an unsupported state dtype, TileLang missing or not the version the kernels are
built for) falls back to vLLM's default backend with ONE warning naming the reason, on vLLM's
logger; ``QLA_STRICT=1`` turns that into :class:`qla_serving.backend.KernelUnavailable`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os

import torch

from qla_serving import backend

# A child of vLLM's "vllm" logger, so the warning goes through vLLM's handlers and format.
logger = logging.getLogger("vllm.qla_serving")

_warned: set[str] = set()

STATE_DTYPES = (torch.float32, torch.bfloat16)


def _required_tilelang() -> str | None:
    """The TileLang version qla-serving's ``gpu`` extra pins, from the installed metadata."""
    try:
        requirements = importlib.metadata.requires("qla-serving") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requirements:
        name, _, rest = req.partition("==")
        if name.strip().lower() == "tilelang" and rest:
            return rest.split(";")[0].strip()
    return None


def _installed_tilelang() -> str | None:
    """The version of the TileLang that imports (a staged copy on PYTHONPATH can differ from
    the one pip installed, so ask the module first, then the metadata)."""
    try:
        import tilelang

        version = getattr(tilelang, "__version__", None)
        if version:
            return str(version)
    except Exception:  # a TileLang that does not even import: let the kernels report it
        return None
    try:
        return importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:
        return None


def tilelang_unsupported_reason() -> str | None:
    """Why the installed TileLang cannot build the kernels, or None.

    vLLM pins its own TileLang (0.1.9 for vLLM 0.26, 0.1.12 for 0.27-0.32); the kernels are
    written for the version qla-serving's ``gpu`` extra names. ``QLA_ALLOW_TILELANG=1`` skips
    the version comparison (for trying another TileLang on purpose).
    """
    if importlib.util.find_spec("tilelang") is None:
        return "TileLang is not installed (pip install 'qla-serving[gpu]')"
    want = _required_tilelang()
    if want is None or os.environ.get("QLA_ALLOW_TILELANG") == "1":
        return None
    have = _installed_tilelang()
    if have is None:
        return None  # no version to compare with
    if have.split("+")[0] != want:
        return f"TileLang {have} is installed but the kernels are built for TileLang {want}"
    return None


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
    # The model's own limits first: they hold on every machine, so the message names them
    # even where the device is also unsuitable.
    reason = backend.config_unsupported_reason(head_k_dim, head_v_dim, activation_dtype)
    if reason is None and state_dtype not in STATE_DTYPES:
        reason = f"the recurrent state cache is {state_dtype}; the kernels keep it in float32 or bfloat16"
    if reason is None:
        reason = backend.device_unsupported_reason(torch.device(device))
    return reason if reason is not None else tilelang_unsupported_reason()


def decide(reason: str | None, *, what: str = "GDN layers") -> bool:
    """Apply the fallback policy to ``reason`` (from :func:`unsupported_reason`).

    Returns:
        True when the kernels run; False after warning once per reason (vLLM's default runs).

    Raises:
        qla_serving.backend.KernelUnavailable: ``reason`` is set and ``QLA_STRICT=1``.
    """
    if reason is None:
        return True
    if backend.strict_mode():
        raise backend.KernelUnavailable(
            f"qla-serving: --linear-attn-backend flashqla cannot run the {what}: {reason}; "
            "QLA_STRICT=1 forbids falling back to vLLM's default backend"
        )
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(
            "qla-serving: flashqla cannot run the %s (%s); falling back to vLLM's default GDN backend.",
            what, reason,
        )
    return False
