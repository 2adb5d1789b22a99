"""Batch invariance of the kernels: one sequence run alone and at a place in a larger call.

A served request is run alone by the stress harness's oracle and among other requests under load
(``e2e_bench/stress.py``); whatever the kernels compute differently for the same sequence in the
two calls shows as drift from the oracle. The decode tile follows the call's (sequence, head) pair
count, but its lanes per row, which alone set the order of the sums over K, are one per pool dtype
(``kernels/configs.py``); AutoCP splits a long sequence by what else the batch holds, and
``QLA_BATCH_INVARIANT=1`` turns it off (:func:`qla_serving.backend.batch_invariant`).

``python -m qla_serving.bench.invariance`` (on the GPU) prints, for each pool dtype, how far the
sequence's output and state move between the two calls with the flag off and on; the GPU tests in
``tests/test_batch_invariance.py`` assert the decode's bits equal with the configured tiles and the
prefill's with the flag on. It also runs one long prompt whole and cut in two calls, as SGLang's
scheduler hands a prompt over in extends (:func:`prefill_whole_and_cut`), ours and FLA's, each
against the float64 recurrence.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import torch

from .common import rel_err

K = V = 128


@contextlib.contextmanager
def env_set(name: str, value: str):
    """The environment variable ``name`` set to ``value`` inside, as it was after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def batch_invariant(on: bool):
    """``QLA_BATCH_INVARIANT`` set to ``on`` inside (the planner reads it per plan)."""
    return env_set("QLA_BATCH_INVARIANT", "1" if on else "0")


def _generator(seed: int | None, device: str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else int(torch.randint(2**31, ())))
    return gen


def _prefill_inputs(T: int, H: int, HV: int, gen: torch.Generator, device: str) -> tuple:
    """q, k ``[T, H, K]`` and v ``[T, HV, V]`` bf16, g and beta ``[T, HV]`` float32, from ``gen``."""
    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q, k, v = randn(T, H, K).bfloat16(), randn(T, H, K).bfloat16(), randn(T, HV, V).bfloat16()
    g = torch.nn.functional.logsigmoid(randn(T, HV) + 4.0)  # log decay <= 0, mostly slow (long memory)
    return q, k, v, g, torch.sigmoid(randn(T, HV))


def decode_alone_and_in_batch(pool_dtype: torch.dtype, *, batch: int = 64, num_qk_heads: int = 16,
                              num_v_heads: int = 32, seed: int | None = None) -> dict:
    """One single-token decode step of one sequence alone and at a random place among ``batch - 1``
    others (the engines' dtypes: bf16 activations, fp32 ``A_log``, bf16 ``dt_bias``, int32 slots,
    q/k L2-normalised in the kernel, the pool updated in place), on fresh random inputs.

    Returns ``out`` (``[2, 1, HV, V]`` bf16: alone, in the batch), ``state`` (``[2, HV, V, K]`` in
    ``pool_dtype``), the inputs of that sequence (``inputs``: q, k, v, a, b, A_log, dt_bias, its
    initial state) and the tiles the two calls used (``tiles``)."""
    from ..kernels import decode

    gen = _generator(seed, "cuda")
    N, H, HV = batch, num_qk_heads, num_v_heads

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = randn(N, 1, H, K).bfloat16(), randn(N, 1, H, K).bfloat16()
    v = randn(N, 1, HV, V).bfloat16()
    a, b = randn(N, 1, HV).bfloat16(), randn(N, 1, HV).bfloat16()
    A_log = torch.rand(HV, device="cuda", generator=gen) * math.log(16)
    dt_bias = (randn(HV) * 0.5).bfloat16()
    init = randn(N, HV, V, K).to(pool_dtype)
    j = int(torch.randint(N, (), device="cuda", generator=gen))
    outs, states, tiles = [], [], []
    for rows, at in ((slice(j, j + 1), 0), (slice(0, N), j)):
        pool = init[rows].clone()
        n = pool.shape[0]
        out = torch.full((n, 1, HV, V), float("nan"), device="cuda", dtype=torch.bfloat16)
        decode.gated_delta_rule_decode_fwd(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias,
                                           state_pool=pool, state_indices=torch.arange(n, device="cuda", dtype=torch.int32),
                                           scale=K**-0.5, use_qk_l2norm=True, out=out, inplace_final_state=True)
        outs.append(out[at])
        states.append(pool[at])
        tiles.append(str(decode._tile_for(n * HV, pool_dtype)))
    torch.cuda.synchronize()
    one = slice(j, j + 1)
    return {"out": torch.stack(outs), "state": torch.stack(states), "tiles": tiles,
            "inputs": (q[one], k[one], v[one], a[one], b[one], A_log, dt_bias, init[one])}


def prefill_alone_and_beside(pool_dtype: torch.dtype, *, length: int = 4096, before: int = 1000, after: int = 3000,
                             num_qk_heads: int = 16, num_v_heads: int = 32, seed: int | None = None) -> dict:
    """A ``length``-token prefill of one sequence alone and between sequences of ``before`` and
    ``after`` tokens, each call planned as the adapters plan a batch (with the value-head count,
    so AutoCP decides), from an initial state in the pool, fresh random inputs.

    Returns ``out`` (``[2, length, HV, V]``: alone, beside), ``state`` (``[2, HV, V, K]``: its final
    state) and whether each call's plan split it (``split``: AutoCP)."""
    from ..ops.gated_delta_rule.chunk import chunk_gated_delta_rule_pool
    from ..plan import plan_prefill

    gen = _generator(seed, "cuda")
    T, H, HV = before + length + after, num_qk_heads, num_v_heads
    q, k, v, g, beta = _prefill_inputs(T, H, HV, gen, "cuda")
    init = (torch.randn(3, HV, V, K, device="cuda", generator=gen) * 0.1).to(pool_dtype)
    outs, states, split = [], [], []
    for lens, start, at in (([length], before, 0), ([before, length, after], 0, 1)):
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        rows = slice(start, start + cu[-1])
        pool = init[1 - at:1 - at + len(lens)].clone()
        plan = plan_prefill(cu, device="cuda", num_v_heads=HV)
        o = chunk_gated_delta_rule_pool(q[rows], k[rows], v[rows], g[rows], beta[rows], pool,
                                        torch.arange(len(lens), device="cuda", dtype=torch.int32),
                                        use_qk_l2norm_in_kernel=True, plan=plan)
        outs.append(o[cu[at]:cu[at + 1]])
        states.append(pool[at])
        split.append(plan.context_parallel is not None
                     and len(plan.context_parallel.segments[at]) > 1)
    torch.cuda.synchronize()
    return {"out": torch.stack(outs), "state": torch.stack(states), "split": split}


def prefill_whole_and_cut(pool_dtype: torch.dtype, *, length: int = 12000, cut: int | None = None,
                          num_qk_heads: int = 16, num_v_heads: int = 32, seed: int | None = None,
                          device: str | None = None) -> dict:
    """One ``length``-token prefill whole in one call and cut in two at token ``cut``, the second
    call continuing from the state the first left in the pool: how SGLang's scheduler hands a long
    prompt over in extends, cut where the step's token budget ends, which under load is elsewhere
    than alone. Planned without AutoCP (no head count), so the cut is the only difference. FLA's
    ``chunk_gated_delta_rule`` is run the same two ways where it imports and the device is CUDA.

    Args:
        pool_dtype: the pool's dtype, ``torch.float32`` (SGLang) or ``torch.bfloat16``.
        length: the prompt's tokens.
        cut: tokens of the first call, ``0 < cut < length``; default a random place that is not a
            multiple of the 64-token chunk.
        num_qk_heads, num_v_heads: heads per layer (GVA: the second a multiple of the first).
        seed: the inputs' seed (default a fresh one).
        device: default ``cuda`` where there is one (the kernels), else ``cpu`` (the op's reference).

    Returns ``cut``; per implementation (``qla``, ``fla`` where it ran) a dict of ``out``
    (``[2, length, HV, V]`` in bf16: whole, cut) and ``state`` (``[2, HV, V, K]`` float32: the final
    state); and ``ref``: the float64 recurrence's ``out`` ``[length, HV, V]`` and ``state``."""
    from ..ops.gated_delta_rule.chunk import chunk_gated_delta_rule_pool
    from ..ops.gated_delta_rule.naive import recurrent_gated_delta_rule_ref
    from ..plan import plan_prefill

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = _generator(seed, device)
    T, H, HV = length, num_qk_heads, num_v_heads
    if cut is None:
        cut = int(torch.randint(1, T, (), device=device, generator=gen))
        cut -= cut % 64 == 0  # off the chunk grid, as a token budget's end mostly is
    if not 0 < cut < T:
        raise ValueError(f"cut={cut}: the first call's tokens must be in 1..{T - 1} (length={T})")
    q, k, v, g, beta = _prefill_inputs(T, H, HV, gen, device)
    init = (torch.randn(1, HV, V, K, device=device, generator=gen) * 0.1).to(pool_dtype)
    index = torch.zeros(1, device=device, dtype=torch.int32)
    result: dict = {"cut": cut}

    outs, states = [], []
    for parts in ((slice(0, T),), (slice(0, cut), slice(cut, T))):
        pool = init.clone()
        o = [chunk_gated_delta_rule_pool(q[r], k[r], v[r], g[r], beta[r], pool, index, use_qk_l2norm_in_kernel=True,
                                         plan=plan_prefill([0, r.stop - r.start], device=device)) for r in parts]
        outs.append(torch.cat(o))
        states.append(pool[0].float())
    result["qla"] = {"out": torch.stack(outs), "state": torch.stack(states)}

    fla = _fla_chunk() if device == "cuda" else None
    try:
        if fla is not None:
            result["fla"] = _fla_whole_and_cut(fla, q, k, v, g, beta, init, cut)
    except Exception as e:  # noqa: BLE001 (FLA's own failure is a finding to print, not the measurement's end)
        result["fla_error"] = f"{type(e).__name__}: {e}"

    o_ref, s_ref, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=init.double(), use_qk_l2norm=True)
    result["ref"] = {"out": o_ref, "state": s_ref[0]}
    if device == "cuda":
        torch.cuda.synchronize()
    return result


def _fla_whole_and_cut(fla, q, k, v, g, beta, init, cut) -> dict:
    """FLA's chunked op on one sequence whole and cut at ``cut``; outputs and states as ours."""
    T, H, HV = q.shape[0], q.shape[1], v.shape[1]
    rep = HV // H  # value head i reads q/k head i // rep, as the engines' GVA does
    qe, ke = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    outs, states = [], []
    for parts in ((slice(0, T),), (slice(0, cut), slice(cut, T))):
        state = init.float().transpose(-1, -2).contiguous()  # FLA keeps the state [N, H, K, V]
        o = []
        for r in parts:
            y, state = fla(qe[r][None], ke[r][None], v[r][None], g[r][None], beta[r][None], initial_state=state,
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
            o.append(y[0])
        outs.append(torch.cat(o))
        states.append(state[0].transpose(-1, -2).float())
    return {"out": torch.stack(outs), "state": torch.stack(states)}


def _fla_chunk():
    """FLA's chunked gated delta rule, or None where FLA does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def _moved(x: torch.Tensor) -> str:
    """How far the second of two results is from the first: elements that differ, largest difference."""
    d = (x[1].double() - x[0].double()).abs()
    return f"{int((d > 0).sum())} of {d.numel()} differ, max {float(d.max()):.3g}"


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    print(f"# batch invariance on {torch.cuda.get_device_name()}: one sequence alone and in a larger call")
    for pool_dtype in (torch.float32, torch.bfloat16):
        for on in (False, True):
            with batch_invariant(on):
                d = decode_alone_and_in_batch(pool_dtype, seed=1)
                p = prefill_alone_and_beside(pool_dtype, seed=2)
            flag = f"QLA_BATCH_INVARIANT={int(on)}"
            print(f"decode  {str(pool_dtype)[6:]:8s} {flag}: tiles {d['tiles'][0]} / {d['tiles'][1]}; "
                  f"output {_moved(d['out'])}; state {_moved(d['state'])}")
            print(f"prefill {str(pool_dtype)[6:]:8s} {flag}: AutoCP split {p['split'][0]} / {p['split'][1]}; "
                  f"output {_moved(p['out'])}; state {_moved(p['state'])}")
        with batch_invariant(False), env_set("QLA_CP_PER_SEQUENCE", "1"):
            p = prefill_alone_and_beside(pool_dtype, seed=2)
        print(f"prefill {str(pool_dtype)[6:]:8s} QLA_CP_PER_SEQUENCE=1: AutoCP split {p['split'][0]} / {p['split'][1]}; "
              f"output {_moved(p['out'])}; state {_moved(p['state'])}")
    print("# one prompt whole and cut in two calls (as SGLang's extends), no AutoCP; error against float64")
    for pool_dtype in (torch.float32, torch.bfloat16):
        c = prefill_whole_and_cut(pool_dtype, seed=3)
        for impl in ("qla", "fla"):
            if impl in c:
                r = c[impl]
                print(f"cut {str(pool_dtype)[6:]:8s} {impl} at {c['cut']}: output {_moved(r['out'])}; state "
                      f"{_moved(r['state'])}; rel err whole / cut: output {rel_err(r['out'][0], c['ref']['out']):.3g} / "
                      f"{rel_err(r['out'][1], c['ref']['out']):.3g}, state {rel_err(r['state'][0], c['ref']['state']):.3g} / "
                      f"{rel_err(r['state'][1], c['ref']['state']):.3g}")
        if "fla_error" in c:
            print(f"cut {str(pool_dtype)[6:]:8s} fla: failed ({c['fla_error']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
