"""A state fault a benchmark server can be started with: the positive control of the stress
harness's agreement.

The stress harness (``e2e_bench/stress.py``) compares each request's answer under load with the
same request answered alone by the same backend. On weights whose next-token distributions are
flat (``--weights random``) every backend drifts from its oracle by bf16 numerics, so what a wrong
state does to that comparison has to be measured too: a server started with
``QLA_BENCH_FAULT=swap-decode-slots`` (the harness's ``flashqla-fault`` backend) runs ``flashqla``
with the first two rows of every decode step reading and writing each other's state slot, the
kind of slot mix-up a strided or misaligned index array causes. A request alone has no second live
row, so its oracle is unaffected; under load the two requests at the front of each decode batch
trade states.

Benchmark use only: the plugin installs it from its benchmark hooks (vLLM's ``qla_dummy`` load
format) when the variable is set, and logs that it did.
"""

from __future__ import annotations

import os

#: the environment variable the benchmark hooks read
FAULT_ENV = "QLA_BENCH_FAULT"
FAULTS = ("swap-decode-slots",)


def requested_fault() -> str | None:
    """The fault ``QLA_BENCH_FAULT`` names, or None when unset or empty."""
    value = os.environ.get(FAULT_ENV, "").strip().lower()
    if not value:
        return None
    if value not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={value!r}: expected one of {', '.join(FAULTS)}")
    return value


def swap_first_live_slots(slots, min_slot: int):
    """``slots`` with its first two entries exchanged when both are live (``>= min_slot``), on the
    device and without a host sync (CUDA-graph safe); a copy, ``slots`` is left as it is."""
    import torch

    if slots.shape[0] < 2:
        return slots
    both = (slots[0] >= min_slot) & (slots[1] >= min_slot)
    out = slots.clone()
    out[0] = torch.where(both, slots[1], slots[0])
    out[1] = torch.where(both, slots[0], slots[1])
    return out


def install_vllm_fault(name: str) -> str:
    """Install fault ``name`` on the vLLM plugin's GDN layer class; returns what it does, for the log."""
    from qla_serving.integrations.vllm import layer
    from qla_serving.integrations.vllm.metadata import VLLM_NULL_BLOCK_ID

    cls = layer.QlaGatedDeltaNetAttention
    if getattr(cls, "_qla_fault", None) == name:
        return f"{name} (already installed)"
    decode = cls._qla_decode

    def faulty_decode(self, x, a, b, ssm_state, slots, out, md=None):
        # the bound launches keep the first layer's slots: a faulted server runs the ops' path
        self.qla_bound_launch = False
        return decode(self, x, a, b, ssm_state, swap_first_live_slots(slots, VLLM_NULL_BLOCK_ID + 1), out, md)

    cls._qla_decode = faulty_decode
    cls._qla_fault = name
    return f"{name}: the first two live rows of every decode step read and write each other's state slot"
