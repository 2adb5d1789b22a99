"""The stress harness's positive control: the state fault a benchmark server can be started with."""

from __future__ import annotations

import pytest
import torch

from qla_serving.bench import faults


@pytest.mark.parametrize("slots, expected", [
    ([5, 7, 0, 0], [7, 5, 0, 0]),   # two live rows trade slots; padded rows stay
    ([5, 7, 9], [7, 5, 9]),
    ([5, 0, 0], [5, 0, 0]),         # a request alone (CUDA-graph padding after it): untouched
    ([0, 5], [0, 5]),
    ([4], [4]),
])
def test_swap_first_live_slots(slots, expected):
    t = torch.tensor(slots, dtype=torch.int32)
    got = faults.swap_first_live_slots(t, min_slot=1)
    assert got.tolist() == expected and t.tolist() == slots


def test_requested_fault(monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    assert faults.requested_fault() is None
    monkeypatch.setenv(faults.FAULT_ENV, "swap-decode-slots")
    assert faults.requested_fault() == "swap-decode-slots"
    monkeypatch.setenv(faults.FAULT_ENV, "stale")
    with pytest.raises(ValueError, match="swap-decode-slots"):
        faults.requested_fault()
