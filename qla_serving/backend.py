"""Which path an op runs: the kernels or the PyTorch reference.

The kernels come from a precompiled library (:mod:`qla_serving.kernels.library`, no TileLang
needed) or, for a configuration no library holds, are compiled by a TileLang of the version they
are written for. Decided per (op, device, static configuration) and logged once. A configuration the kernels
do not support falls back to the reference with one warning naming the reason; with
``QLA_STRICT=1`` it raises :class:`KernelUnavailable` instead.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from . import plan
from .constants import HEAD_DIM
from .kernels import library
from .kernels.library import TILELANG_VERSION, KernelUnavailable  # noqa: F401 - this module's API too

logger = logging.getLogger("qla_serving")

_warned: set[tuple[str, str]] = set()


def strict_mode() -> bool:
    return plan.env_flag("QLA_STRICT")


def packed_prefill() -> bool:
    """Whether the vLLM adapter hands the prefill vLLM's conv output and raw gate inputs
    (:func:`~qla_serving.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_pool_packed`, the
    default) or, with ``QLA_PREFILL_PACKED=0``, vLLM's split, normalised and gated q, k, v, g, beta
    (one more pass per layer; the A/B in docs/e2e.md)."""
    return os.environ.get("QLA_PREFILL_PACKED", "1").strip().lower() not in ("0", "false", "no", "off")


def bound_launches() -> bool:
    """Whether the vLLM adapter, with ``QLA_BOUND_LAUNCH=1``, runs a step's later GDN layers on
    the launches its first layer bound (the ops' ``bind``: the same kernels and step constants,
    each layer's own tensor addresses, its layout checked equal) instead of calling the ops,
    their checks and the kernel entries again per layer. Off by default: exact on the GPU, but
    no faster served (docs/e2e.md, "The bound launches, served")."""
    return plan.env_flag("QLA_BOUND_LAUNCH")


def fresh_rows_on_decode() -> bool:
    """Whether the vLLM adapter runs a new one-token prompt's first token on the decode kernel
    also where vLLM's split makes it a prefill row (behind a longer row of the step), as it does
    alone or among decodes, so that its answer does not depend on its place in the batch: the
    chunked prefill's bf16 intermediates leave a one-token state further from exact than the
    decode's (docs/e2e.md, "The one-token tail"). On by default; ``QLA_FRESH_ON_DECODE=0`` keeps
    the prefill's answer."""
    return os.environ.get("QLA_FRESH_ON_DECODE", "1").strip().lower() not in ("0", "false", "no", "off")


def batch_invariant() -> bool:
    """Whether ``QLA_BATCH_INVARIANT=1`` asks that a sequence's outputs and states be the same bits
    whatever else its step holds: the prefill plans no AutoCP (whose segments, and whether it
    splits at all, follow the batch); the decode needs nothing, its configured bands share one lane
    count per pool dtype (``kernels/configs.py``), so one summation order. Off by default: it gives
    up AutoCP's speed on long prompts in small batches (docs/e2e.md, "Batch invariance")."""
    return plan.env_flag("QLA_BATCH_INVARIANT")


def batch_invariant_note(engine_switch: str | None = None) -> str:
    """What the engines' start-up line adds under ``QLA_BATCH_INVARIANT=1``, else when the engine's
    own switch ``engine_switch`` (its name; the adapter passes it when the switch is on) or
    ``QLA_CP_PER_SEQUENCE=1`` plans AutoCP per sequence (``qla_serving.plan``); "" otherwise."""
    if batch_invariant():
        return "; batch-invariant (QLA_BATCH_INVARIANT=1): no AutoCP (the decode has one reduction order at every batch size)"
    asked = engine_switch or ("QLA_CP_PER_SEQUENCE=1" if plan.env_flag("QLA_CP_PER_SEQUENCE") else None)
    if asked:
        return f"; AutoCP splits each sequence as it would alone ({asked}): batch-invariant bits"
    return ""


@functools.lru_cache(maxsize=None)
def device_unsupported_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` at all, or None when they can."""
    if device.type != "cuda":
        return f"tensors are on {device.type}, the kernels need a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"GPU compute capability is {major}.{minor}, the kernels are built for SM90 (Hopper)"
    return kernel_source_unsupported_reason()


def tilelang_unsupported_reason() -> str | None:
    """Why the installed TileLang cannot build the kernels, or None
    (:func:`qla_serving.kernels.library.tilelang_unsupported_reason`)."""
    return library.tilelang_unsupported_reason()


def kernel_source_unsupported_reason() -> str | None:
    """Why no kernel at all can be had here (no precompiled library and no TileLang to compile
    with), or None."""
    reason = library.tilelang_unsupported_reason()
    if reason is None:
        return None
    if library.libraries():
        return None
    return f"no precompiled kernel library ({library.describe_search_path()}) and {reason}"


def missing_kernels_reason(specs) -> str | None:
    """Why the kernels of these warm-up specs (:func:`qla_serving.warmup.kernel_warmup_specs`)
    cannot all be had, or None: each is in a precompiled library, or TileLang can compile it."""
    if library.tilelang_unsupported_reason() is None:
        return None
    import importlib

    missing = []
    for _, module, _, kwargs in specs:
        missing += importlib.import_module(module).missing(**kwargs)
    if not missing:
        return None
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (f"the kernel {missing[0]}{more} is in no precompiled kernel library ({library.describe_search_path()}) "
            f"and {library.tilelang_unsupported_reason()}; build them with `qla-serving compile`")


STATE_DTYPES = (torch.float32, torch.bfloat16)  # the recurrent-state pools the kernels keep


def config_unsupported_reason(head_k: int, head_v: int, dtype: torch.dtype,
                              state_dtype: torch.dtype | None = None) -> str | None:
    """Why the kernels cannot run these head dims, activation dtype and state-pool dtype, or None."""
    if head_k != HEAD_DIM or head_v != HEAD_DIM:
        return f"head dims K={head_k}, V={head_v}; the kernels need K = V = {HEAD_DIM}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"activations are {dtype}; the kernels take bfloat16 or float16"
    if state_dtype is not None and state_dtype not in STATE_DTYPES:
        return f"the recurrent state cache is {state_dtype}; the kernels keep it in float32 or bfloat16"
    return None


def unsupported_reason(device: torch.device, head_k: int, head_v: int, dtype: torch.dtype,
                       state_dtype: torch.dtype | None = None) -> str | None:
    """Why the kernels cannot run here, or None: the one decision the ops and both engine
    adapters ask. The model's limits come first (they hold on every machine, so the message
    names them even where the device is also unsuitable), then the device and TileLang."""
    return (config_unsupported_reason(head_k, head_v, dtype, state_dtype)
            or device_unsupported_reason(torch.device(device)))


def fall_back_once(message: str, seen: set, key, *, strict_message: str | None = None,
                   log: logging.Logger = logger) -> None:
    """The fallback policy of every path (ops and engine adapters) in one place.

    Raises :class:`KernelUnavailable` (``strict_message``, else ``message``) under
    ``QLA_STRICT=1``; otherwise logs ``message`` on ``log`` the first time ``key`` is seen in
    ``seen``, so a fallback is said once, not on every call.
    """
    if strict_mode():
        raise KernelUnavailable(strict_message or message)
    if key not in seen:
        seen.add(key)
        log.warning(message)


def _fall_back(op: str, reason: str) -> None:
    fall_back_once(f"qla-serving {op}: running the PyTorch reference, not the kernels: {reason}", _warned,
                   (op, reason), strict_message=f"qla-serving {op}: kernels unavailable ({reason}) and QLA_STRICT=1")


def use_kernels(op: str, device: torch.device, head_k: int, head_v: int, dtype: torch.dtype) -> bool:
    """True when ``op`` should run on the kernels; otherwise log once (or raise in strict mode)."""
    if os.environ.get("QLA_FORCE_REFERENCE") == "1":
        reason = "QLA_FORCE_REFERENCE=1"
    else:
        reason = unsupported_reason(device, head_k, head_v, dtype)
    if reason is None:
        return True
    _fall_back(op, reason)
    return False


def kernel_entry(op: str, load, device: torch.device, head_k: int, head_v: int, dtype: torch.dtype):
    """``load()`` (the op's own import of its kernel entry point) when ``op`` runs on the kernels,
    else None.

    A configuration the kernels do not support, or a kernel module that does not import,
    falls back (one warning) or raises under ``QLA_STRICT=1``.
    """
    if not use_kernels(op, device, head_k, head_v, dtype):
        return None
    try:
        return load()
    except ImportError as e:
        _fall_back(op, f"the kernel module does not import ({e})")
        return None
