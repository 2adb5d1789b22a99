"""The prefill benchmark's CPU-side pieces: how each implementation's result is read back."""

import sys

import pytest
import torch

from qla_serving.bench import prefill


@pytest.mark.parametrize("impl", ["qla", "qla-nocp", "qla-packed", "qla-bf16-state", "fla", "flashinfer", "qwen-flashqla"])
def test_standard_outputs_gives_our_layouts(impl):
    T, N, HV, D = 40, 3, 4, 8
    o = torch.randn(T, HV, D)
    state = torch.randn(N, HV, D, D)  # [N, HV, V, K]
    # what each runner returns for that output and state
    raw_o = o.unsqueeze(0) if impl in ("fla", "qwen-flashqla") else o
    raw_state = state.transpose(-1, -2).contiguous() if impl == "fla" else state
    got_o, got_state = prefill.standard_outputs(impl, (raw_o, raw_state))
    assert got_o.shape == (T, HV, D) and torch.equal(got_o, o)
    assert got_state.shape == (N, HV, D, D) and torch.equal(got_state, state)


def test_qwen_flashqla_runner_without_the_library_is_an_import_error(monkeypatch):
    # the benchmark turns this into an "unavailable" note and goes on with the other implementations
    monkeypatch.setitem(sys.modules, "flash_qla", None)
    with pytest.raises(ImportError):
        prefill.RUNNERS["qwen-flashqla"]({}, 2, 8)
