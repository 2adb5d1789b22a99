"""Paged recurrent-state pool for the GDN layers (see :mod:`qla_serving.state.pool`)."""

from .pool import PoolExhaustedError, SlotError, StateCheckpoint, StatePool

__all__ = ["StatePool", "StateCheckpoint", "PoolExhaustedError", "SlotError"]
