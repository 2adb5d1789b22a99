"""Random inputs for the tests (fresh on every run: the seed comes from conftest), and a stand-in kernel library."""

from __future__ import annotations

import torch

from qla_serving.bench.common import rel_err as common_rel_err
from qla_serving.ops.gated_delta_rule.naive import gdn_gate_ref, recurrent_decode_ref

GATE_MODES = ("zero", "mild", "qwen", "strong")


def make_gates(T: int, HV: int, mode: str, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` ``[T, HV]``: no decay, mild decay, Qwen-style gates, or -20 per token."""
    beta = torch.rand(T, HV, dtype=dtype)
    if mode == "zero":
        g = torch.zeros(T, HV, dtype=dtype)
    elif mode == "mild":
        g = -torch.rand(T, HV, dtype=dtype) * 0.1
    elif mode == "strong":
        g = -torch.rand(T, HV, dtype=dtype) * 19 - 1  # -1 .. -20
        g[:, 0] = -20.0
    elif mode == "qwen":
        A_log = torch.empty(HV, dtype=dtype).uniform_(-4, 1.5)
        g, beta = gdn_gate_ref(torch.randn(T, HV, dtype=dtype), torch.randn(T, HV, dtype=dtype), A_log,
                               torch.randn(HV, dtype=dtype) * 0.5, dtype)
    else:
        raise ValueError(mode)
    return g, beta


def make_qkv(T: int, H: int, HV: int, K: int, V: int, dtype=torch.float64):
    return (torch.randn(T, H, K, dtype=dtype), torch.randn(T, H, K, dtype=dtype), torch.randn(T, HV, V, dtype=dtype))


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()])


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The package's error metric (:func:`qla_serving.bench.common.rel_err`); a non-finite value in
    ``x`` fails at once, naming the cause."""
    assert torch.isfinite(x.cpu()).all(), "non-finite values (an unwritten element or an overflow)"
    return common_rel_err(x, ref)


def max_rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error over the reference's largest magnitude (elementwise bound)."""
    ref = ref.double().cpu()
    return float((x.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def verify_ref(q, k, v, a, b, A_log, dt_bias, initial_state, N: int, T: int):
    """The oracle of a speculative verify: ``N`` sequences of ``T`` tokens, given flat (``N * T``
    tokens, as the engines pass them), from ``initial_state`` ``[N, HV, V, K]``; returns
    ``(o [N, T, HV, V], states after each token [N, T, HV, V, K])``."""
    H, K = q.shape[-2:]
    HV, V = v.shape[-2:]
    return recurrent_decode_ref(q.view(N, T, H, K), k.view(N, T, H, K), v.view(N, T, HV, V), a.view(N, T, HV),
                                b.view(N, T, HV), A_log, dt_bias, initial_state, scale=K**-0.5)


class RecordingLib:
    """Stands in for a kernel library's CDLL: every ``<symbol>_call`` records its C arguments."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name.endswith("_call"):
            def call(*args):
                self.calls.append(args)
                return 0
            return call
        return (lambda: b"") if name.endswith("_get_last_error") else (lambda: 0)


def recorded_kernel(lib, symbol, args):
    """A LibraryKernel for ``lib`` whose C parameters follow ``args`` (a call's arguments as a
    TileLang kernel receives them): a pointer per tensor, then a shape variable per tensor dim."""
    params, dynamic = [], []
    for i, a in enumerate(args):
        if hasattr(a, "data_ptr"):
            params.append(["ptr", f"arg{i}"])
            dynamic += [[f"arg{i}_dim{d}", i, d] for d in range(len(a.shape))]
        else:
            params.append(["float" if isinstance(a, float) else "int64_t", f"arg{i}"])
    entry = dict(symbol=symbol, num_args=len(args), dynamic=dynamic, params=params + [["int", d[0]] for d in dynamic])
    from qla_serving.kernels import library

    return library.LibraryKernel(lib, entry, "test")
