"""Input checks shared by the ops. Each error names the constraint that was broken.

Checks that would need device values on the host (index ranges, distinct slots) run when
the indices are on the CPU, and on CUDA only with ``QLA_CHECK_INDICES=1``: a device->host
sync in every layer would cost more than the check is worth in serving.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from ...backend import STATE_DTYPES

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POOL_DTYPES = STATE_DTYPES  # the pools the kernels keep; the reference path takes the same
INDEX_DTYPES = (torch.int32, torch.int64)


# These run on every op call, in every layer: the common (valid) case does the comparison and
# nothing else; the error message is built only when a check fails.


def expect_rank(name: str, x: torch.Tensor, ranks: Iterable[int], layout: str) -> None:
    if not isinstance(ranks, tuple):
        ranks = tuple(ranks)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in ranks:
        raise ValueError(f"{name} must have rank {' or '.join(map(str, ranks))} ({layout}), got shape {tuple(x.shape)}")


def expect_shape(name: str, x: torch.Tensor, shape: tuple, layout: str) -> None:
    if x.shape != shape and tuple(x.shape) != tuple(shape):  # torch.Size is a tuple: equal to a tuple
        raise ValueError(f"{name} must have shape {tuple(shape)} ({layout}), got {tuple(x.shape)}")


def expect_dtype(name: str, x: torch.Tensor, dtypes: Iterable[torch.dtype]) -> None:
    if not isinstance(dtypes, tuple):
        dtypes = tuple(dtypes)
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; expected one of {names}")


def expect_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}: all tensors must be on one device")


def expect_contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {x.stride()} for shape {tuple(x.shape)})")


def expect_contiguous_all(**tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        expect_contiguous(name, x)


def expect_same_dtype(ref_name: str, ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Every one of ``tensors`` has ``ref``'s dtype."""
    for name, x in tensors.items():
        if x.dtype != ref.dtype:
            names = [ref_name, *tensors]
            raise TypeError(f"{name} has dtype {x.dtype} but {ref_name} has {ref.dtype}: "
                            f"{', '.join(names[:-1])} and {names[-1]} must share a dtype")


def expect_heads(H: int, HV: int) -> None:
    if H <= 0 or HV % H:
        raise ValueError(f"value heads HV={HV} must be a positive multiple of q/k heads H={H} (GVA)")


def expect_pool(name: str, pool: torch.Tensor, HV: int, V: int, K: int) -> None:
    """A state pool ``[num_slots, HV, V, K]``: inner dims contiguous, any slot stride."""
    expect_rank(name, pool, (4,), "[num_slots, HV, V, K]")
    if tuple(pool.shape[1:]) != (HV, V, K):
        raise ValueError(f"{name} must be [num_slots, HV={HV}, V={V}, K={K}], got {tuple(pool.shape)}")
    expect_dtype(name, pool, POOL_DTYPES)
    if pool.stride()[1:] != (V * K, K, 1) or pool.stride(0) < HV * V * K:
        raise ValueError(
            f"{name} must have contiguous [HV, V, K] rows (strides (*, {V * K}, {K}, 1) with slot stride "
            f">= {HV * V * K}), got strides {pool.stride()}"
        )


def indices_checked(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" or os.environ.get("QLA_CHECK_INDICES") == "1"


def expect_slots(name: str, idx: torch.Tensor, num_slots: int, n: int, allow_padding: bool,
                 min_slot: int = 0) -> None:
    """``idx``: ``[n]`` int32/int64 slot numbers in ``[0, num_slots)`` (``-1`` = padding if allowed,
    and so is any value below ``min_slot``); the live ones distinct."""
    expect_rank(name, idx, (1,), "[N]")
    expect_shape(name, idx, (n,), "[N], one slot per sequence")
    expect_dtype(name, idx, INDEX_DTYPES)
    if not indices_checked(idx) or idx.numel() == 0:
        return
    lo = -1 if allow_padding else 0
    bad = (idx < lo) | (idx >= num_slots)
    if bool(bad.any()):
        first = int(idx[bad][0])
        allowed = f"[0, {num_slots})" + (" or -1 for a padded row" if allow_padding else "")
        raise IndexError(f"{name} contains {first}, outside the pool's slot range {allowed}")
    live = idx[idx >= max(min_slot, 0)]
    if live.unique().numel() != live.numel():
        raise ValueError(f"{name} names a slot twice: each sequence needs its own state slot")
