"""The prefill benchmark's CPU-side pieces: how each implementation's result is read back."""

import sys

import pytest
import torch

from qla_serving.bench import prefill


@pytest.mark.parametrize("impl", ["qla", "qla-nocp", "qla-per-sequence", "qla-packed", "qla-bf16-state", "fla", "flashinfer",
                                  "qwen-flashqla"])
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


def test_every_implementation_the_command_offers_has_a_runner():
    assert set(prefill.RUNNERS) == set(prefill.IMPLS + prefill.EXTRA_IMPLS)


def test_the_per_sequence_runner_asks_the_planner_for_the_per_sequence_split(monkeypatch):
    """``qla-per-sequence`` plans with ``cp_per_sequence=True``, ``qla`` leaves it to the environment,
    ``qla-nocp`` turns AutoCP off (recorded at the planner; the call stops before any device work)."""
    from qla_serving import plan as plan_mod
    from qla_serving.kernels import chunk_prefill

    asked = []

    class Stop(Exception):
        pass

    def record(*args, **kwargs):
        asked.append((kwargs.get("cp_per_sequence"), kwargs.get("cp_segment_tokens")))
        raise Stop

    monkeypatch.setattr(plan_mod, "plan_prefill", record)
    monkeypatch.setattr(chunk_prefill, "warmup", lambda *a, **kw: None)
    x = {"cu": [0, 4096, 8192], "q": torch.zeros(1, dtype=torch.bfloat16), "beta": torch.zeros(1)}
    for impl in ("qla", "qla-per-sequence", "qla-nocp"):
        with pytest.raises(Stop):
            prefill.RUNNERS[impl](x, 8, 32)
    assert asked == [(None, None), (True, None), (None, 0)]
