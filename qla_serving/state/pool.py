"""The paged recurrent-state pool: one ``[num_slots, HV, V, K]`` tensor per GDN layer.

A request holds one slot for its whole life; every linear-attention layer keeps that
request's state at the same slot number of its own tensor, and the kernels read and write
``pool[state_indices[i]]`` in place. The pool tracks which slots are in use so that misuse
(double free, use after free, a slot number out of range, running out of slots) raises at
the call that made the mistake instead of silently corrupting another request's state.

The pool either owns its tensors or wraps an engine's existing tensors as views (no copy:
vLLM's and SGLang's pools stay the single source of truth). It works on CPU and GPU tensors.
Bookkeeping is host-side Python; data movement (fork, reset, checkpoint) runs on the
tensors' device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

# The pool dtypes the ops accept: one definition, so pool and ops cannot disagree.
from ..ops.gated_delta_rule.checks import POOL_DTYPES


class PoolExhaustedError(RuntimeError):
    """No free slot is left for an allocation."""


class SlotError(ValueError):
    """A slot number that is out of range, or not in the state an operation needs."""


@dataclass(frozen=True)
class StateCheckpoint:
    """A saved copy of one slot's state in every layer (``[HV, V, K]`` each, pool dtype).

    Made by :meth:`StatePool.checkpoint`; restore it with :meth:`StatePool.restore` into any
    allocated slot of a pool with the same layer shapes and dtype.
    """

    states: tuple[torch.Tensor, ...]
    source_slot: int


class StatePool:
    """Slots of recurrent state for ``num_layers`` GDN layers.

    Args:
        num_slots: number of slots (requests that can hold state at once).
        num_v_heads: value heads ``HV`` (after tensor-parallel splitting).
        head_v_dim: ``V`` (rows of each head's state). head_k_dim: ``K`` (columns).
        num_layers: linear-attention layers, one tensor each.
        dtype: float32 or bfloat16.
        device: where the tensors live (CPU or CUDA).

    Attributes:
        layers: list of ``num_layers`` tensors ``[num_slots, HV, V, K]`` (the kernels' pool
            argument); ``[HV, V, K]`` is contiguous per slot.
    """

    def __init__(self, num_slots: int, num_v_heads: int, head_v_dim: int = 128, head_k_dim: int = 128,
                 num_layers: int = 1, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("num_slots", num_slots), ("num_v_heads", num_v_heads), ("head_v_dim", head_v_dim),
                            ("head_k_dim", head_k_dim), ("num_layers", num_layers)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dtype not in POOL_DTYPES:
            raise TypeError(f"pool dtype must be float32 or bfloat16, got {dtype}")
        layers = [torch.zeros(num_slots, num_v_heads, head_v_dim, head_k_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self._init(layers)

    @classmethod
    def from_tensors(cls, tensors: torch.Tensor | Sequence[torch.Tensor]) -> "StatePool":
        """Wrap an engine's existing state tensors as a pool, without copying them.

        Args:
            tensors: one tensor or a list (one per layer) of ``[num_slots, HV, V, K]`` float32
                or bfloat16, same shape, dtype and device; ``[HV, V, K]`` contiguous, any slot
                stride (vLLM's pool is a view sharing a buffer with the conv state).

        Every slot starts free; the engine allocates through the pool (or :meth:`mark_allocated`).
        """
        layers = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not layers:
            raise ValueError("from_tensors needs at least one layer tensor")
        self = cls.__new__(cls)
        self._init(layers)
        return self

    def _init(self, layers: list[torch.Tensor]) -> None:
        first = layers[0]
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"layer {i}: a state tensor must be [num_slots, HV, V, K], "
                                 f"got {getattr(t, 'shape', type(t).__name__)}")
            if t.dtype not in POOL_DTYPES:
                raise TypeError(f"layer {i}: pool dtype must be float32 or bfloat16, got {t.dtype}")
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"layer {i}: {tuple(t.shape)} {t.dtype} on {t.device} differs from layer 0's "
                                 f"{tuple(first.shape)} {first.dtype} on {first.device}; all layers must match")
            _, hv, v, k = t.shape
            if t.stride()[1:] != (v * k, k, 1):
                raise ValueError(f"layer {i}: [HV, V, K] must be contiguous within a slot "
                                 f"(strides (*, {v * k}, {k}, 1)), got strides {t.stride()}")
        self.layers = layers
        self.num_slots = first.shape[0]
        self.num_v_heads, self.head_v_dim, self.head_k_dim = first.shape[1:]
        self.dtype = first.dtype
        self.device = first.device
        # Free slots as a stack: the most recently freed slot is reused first (warm in cache).
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self._allocated: set[int] = set()

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of state one slot holds over all layers (``layers * HV * V * K * itemsize``)."""
        return self.num_layers * self.num_v_heads * self.head_v_dim * self.head_k_dim * self.layers[0].element_size()

    def is_allocated(self, slot: int) -> bool:
        self._check_range(slot)
        return slot in self._allocated

    def allocated_slots(self) -> list[int]:
        return sorted(self._allocated)

    # ---- checks ------------------------------------------------------------------------

    def _check_range(self, slot) -> int:
        if isinstance(slot, torch.Tensor) and slot.numel() == 1 and not slot.is_floating_point():
            slot = int(slot)
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise SlotError(f"a slot number must be an int, got {slot!r}")
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} is out of range: valid slots are 0..{self.num_slots - 1}")
        return slot

    def _check_live(self, slot, what: str) -> int:
        slot = self._check_range(slot)
        if slot not in self._allocated:
            raise SlotError(f"{what}: slot {slot} is not allocated (freed or never allocated); "
                            f"use after free is not allowed")
        return slot

    # ---- allocation --------------------------------------------------------------------

    def allocate(self, n: int | None = None, *, zero: bool = True) -> int | list[int]:
        """Take one free slot (``n=None``) or a list of ``n``; ``zero`` clears their state.

        Raises:
            PoolExhaustedError: fewer than the asked number of slots are free (nothing is
                taken in that case).
        """
        count = 1 if n is None else n
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"allocate(n) takes a non-negative int, got {n!r}")
        if count > len(self._free):
            raise PoolExhaustedError(f"cannot allocate {count} slot(s): only {len(self._free)} of "
                                     f"{self.num_slots} are free")
        slots = [self._free.pop() for _ in range(count)]
        self._allocated.update(slots)
        if zero and slots:
            self._zero(slots)
        return slots[0] if n is None else slots

    def mark_allocated(self, slot: int) -> None:
        """Record that the engine took ``slot`` itself (adapters mirroring an engine's allocator)."""
        slot = self._check_range(slot)
        if slot in self._allocated:
            raise SlotError(f"slot {slot} is already allocated")
        self._free.remove(slot)
        self._allocated.add(slot)

    def free(self, slots: int | Iterable[int]) -> None:
        """Return slot(s) to the pool. Raises :class:`SlotError` on a double free (nothing freed)."""
        items = [slots] if isinstance(slots, int) else list(slots)
        checked = [self._check_live(s, "free") for s in items]
        if len(set(checked)) != len(checked):
            raise SlotError(f"free: slots {checked} name a slot twice (double free)")
        for s in checked:
            self._allocated.remove(s)
            self._free.append(s)

    # ---- data --------------------------------------------------------------------------

    def _zero(self, slots: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        for t in self.layers:
            t.index_fill_(0, idx, 0)

    def reset(self, slots: int | Iterable[int]) -> None:
        """Zero the state of allocated slot(s) in every layer."""
        items = [slots] if isinstance(slots, int) else list(slots)
        self._zero([self._check_live(s, "reset") for s in items])

    def fork(self, src: int, dst: int | None = None) -> int:
        """Copy ``src``'s state (every layer) into ``dst``, or into a newly allocated slot.

        For parallel sampling (n > 1) and prefix-cache hits. Returns the destination slot.
        """
        src = self._check_live(src, "fork source")
        if dst is None:
            dst = self.allocate(zero=False)
        else:
            dst = self._check_live(dst, "fork destination")
            if dst == src:
                raise SlotError(f"fork: source and destination are the same slot {src}")
        for t in self.layers:
            t[dst].copy_(t[src])
        return dst

    def checkpoint(self, slot: int) -> StateCheckpoint:
        """A copy of ``slot``'s state in every layer (on the pool's device)."""
        slot = self._check_live(slot, "checkpoint")
        return StateCheckpoint(states=tuple(t[slot].clone() for t in self.layers), source_slot=slot)

    def restore(self, slot: int, ckpt: StateCheckpoint) -> None:
        """Overwrite allocated ``slot``'s state with a checkpoint's."""
        slot = self._check_live(slot, "restore")
        if not isinstance(ckpt, StateCheckpoint):
            raise TypeError(f"restore takes a StateCheckpoint, got {type(ckpt).__name__}")
        if len(ckpt.states) != self.num_layers:
            raise ValueError(f"checkpoint has {len(ckpt.states)} layers; this pool has {self.num_layers}")
        for t, s in zip(self.layers, ckpt.states):
            if s.shape != t.shape[1:] or s.dtype != t.dtype:
                raise ValueError(f"checkpoint state {tuple(s.shape)} {s.dtype} does not fit the pool's slot "
                                 f"{tuple(t.shape[1:])} {t.dtype}")
            t[slot].copy_(s)

    def slot_indices(self, slots: Sequence[int], pad_to: int | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """``state_indices`` for the kernels: int32 ``[len(slots)]``, or ``[pad_to]`` padded with -1.

        Every slot must be allocated (a padded CUDA-graph batch uses -1 for its empty rows).
        """
        checked = [self._check_live(s, "slot_indices") for s in slots]
        if len(set(checked)) != len(checked):
            raise SlotError(f"slot_indices: {checked} names a slot twice; two rows would race on one state")
        if pad_to is not None:
            if pad_to < len(checked):
                raise ValueError(f"pad_to={pad_to} is smaller than the {len(checked)} slots given")
            checked = checked + [-1] * (pad_to - len(checked))
        return torch.tensor(checked, dtype=torch.int32, device=self.device if device is None else device)

    def __repr__(self) -> str:
        return (f"StatePool(layers={self.num_layers}, slots={self.num_slots} ({self.num_free} free), "
                f"HV={self.num_v_heads}, V={self.head_v_dim}, K={self.head_k_dim}, {self.dtype}, {self.device}, "
                f"{self.bytes_per_slot} B/slot)")
