"""``qla-serving bench prefill``: our chunked GDN prefill vs FLA 0.6.0 and FlashInfer 0.6.14.

Runs the grid of record (head configs x batches, ``HEAD_CONFIGS`` x ``BATCHES``) on one GPU, every implementation on the same
inputs, eager (host overhead counted, as an engine running eagerly pays it) and inside a
CUDA graph, and writes ``e2e_bench/results/<date>-<gpu>-prefill.{json,md}``. Each cell also
gets a roofline floor row (impl ``floor``): FLOPs at the measured bf16 rate or bytes at the
measured copy bandwidth, whichever is larger.

What each implementation is timed doing (bf16 activations, Qwen-style gates, q/k L2 norm
in the kernel, fp32 states, every sequence with an initial state):

* ``qla``: ``chunk_gated_delta_rule_fwd`` on an fp32 state pool in place, plan built once
  outside the timed region (as every layer of a forward pass reuses it).
* ``qla-bf16-state`` (extra): the same on a bf16 state pool, the state vLLM 0.26 keeps for
  Qwen3-Next by default (its kernels read and write the pool in bf16, the state in fp32 between).
* ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (``FLA_FLASH_QLA=0``), with
  ``cu_seqlens_cpu`` given, initial state ``[N, HV, K, V]`` and final state returned.
* ``flashinfer``: ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` with L2-normalised q and k,
  precomputed ``alpha = exp(g)`` and fp32 beta, all made outside the timed call (its input
  contract: FlashInfer 0.6.14 accepts ``use_qk_l2norm_in_kernel`` but does not use it, and vLLM
  0.26 normalises q and k in its fused post-convolution kernel before calling it), fp32 initial
  and output state.
* ``qla-per-sequence`` (extra): ``qla`` with AutoCP planned per sequence (each sequence split as it
  would be alone: the same bits in any batch; ``QLA_CP_PER_SEQUENCE=1``, SGLang's deterministic
  inference), beside ``qla`` (the batch planner) and ``qla-nocp`` in one run.
* ``qwen-flashqla`` (extra, ``--impls ... qwen-flashqla``): the Qwen team's FlashQLA library
  (``flash_qla``, 0.1.3 in the results; not this project, whose engine flag is ``flashqla``):
  its ``chunk_gated_delta_rule``
  with its own AutoCP decision, the state in our ``[N, HV, V, K]`` layout (``state_v_first``),
  fp32 initial state, final state returned. It reads device values on the host (the AutoCP
  decision, chunk indices), so a CUDA graph cannot capture it: its graph rows are missing and
  the notes say why.
"""

import argparse
import contextlib
import math
import os
import sys
import traceback

import torch

from ..constants import CHUNK_SIZE as C
from ..constants import HEAD_DIM
from . import common

HEAD_CONFIGS = [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (16, 48), (8, 24), (16, 16)]
BATCHES = ["1x32768", "1x8192", "1x2048", "24576+8192", "8x4096", "8x1024"]
IMPLS = ["qla", "fla", "flashinfer"]
# ours with AutoCP off, to show what the planner's choice gains; FlashQLA, the Qwen team's TileLang library
# (the 2026-11-22 results of record call it "flashqla"); ours on the engine's packed buffers; ours on a bf16 state pool
EXTRA_IMPLS = ["qla-nocp", "qla-per-sequence", "qwen-flashqla", "qla-packed", "qla-bf16-state"]
K = V = HEAD_DIM


def batch_lens(batch: str) -> list[int]:
    """``"8x4096"`` -> eight 4096s; ``"24576+8192"`` -> [24576, 8192]."""
    lens = []
    for part in batch.split("+"):
        n, _, length = part.rpartition("x")
        lens += [int(length)] * (int(n) if n else 1)
    return lens


def parse_batch(text: str) -> str:
    """An argparse type: a batch in :func:`batch_lens`'s form, every sequence at least one token."""
    try:
        lens = batch_lens(text)
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(f"batch {text!r}: expected NxLEN or LEN+LEN..., e.g. 8x4096 or 24576+8192")
    return text


def make_inputs(lens, hqk, hv, dtype=torch.bfloat16):
    T = sum(lens)
    dev = "cuda"
    q = torch.randn(T, hqk, K, device=dev, dtype=dtype)
    k = torch.randn(T, hqk, K, device=dev, dtype=dtype)
    v = torch.randn(T, hv, V, device=dev, dtype=dtype)
    a, b = torch.randn(T, hv, device=dev), torch.randn(T, hv, device=dev)
    A_log = torch.empty(hv, device=dev).uniform_(0.0, 1.5)
    dt_bias = torch.empty(hv, device=dev).uniform_(-3.0, 0.0)
    g = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias)
    beta = torch.sigmoid(b).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
    h0 = torch.randn(len(lens), hv, V, K, device=dev) * 0.1  # [N, HV, V, K]
    return dict(q=q, k=k, v=v, g=g.contiguous(), beta=beta, cu=cu, h0=h0, a=a, b=b, A_log=A_log, dt_bias=dt_bias)


def num_chunks(lens) -> int:
    """Chunks of the kernels' size over all sequences (each sequence's last one may be partial)."""
    return sum(math.ceil(n / C) for n in lens)


def min_bytes(lens, hqk, hv) -> int:
    """Bytes any implementation must move: bf16 q, k, v read and o written, fp32 g and bf16
    beta read, each sequence's fp32 state read and written."""
    T = sum(lens)
    return T * (2 * hqk * K * 2 + hv * V * 2 * 2 + hv * (4 + 2)) + len(lens) * hv * V * K * 4 * 2


def split_bytes(lens, hqk, hv, least: bool = False) -> int:
    """Bytes a two-kernel split moves beyond :func:`min_bytes`, its first kernel done before
    the second starts (so what passes between them goes through DRAM, less what L2 keeps).

    ``least=False``: our kernels' split: ``prep`` reads q and k a second time (the second for
    ``chunk_fwd``), writes ``T diag(beta)`` (bf16 64x64 per chunk and value head), the gate's
    cumulative sum (fp32) and 1/|q|, 1/|k| (fp32), which ``chunk_fwd`` reads back.
    ``least=True``: the least any split passing the inverse between kernels moves: k read
    twice (the first kernel's ``k k^T``, the second's state update), beta twice (the inverse
    needs it; with FlashQLA's gate-free inverse the first kernel needs no g), and T's lower
    triangle (with its diagonal) in bf16, written and read.
    """
    T, chunks = sum(lens), num_chunks(lens)
    if least:
        return T * hqk * K * 2 + T * hv * 2 + chunks * hv * (C * (C + 1) // 2) * 2 * 2
    return T * hqk * K * 2 * 2 + chunks * (hv * C * C * 2 + hv * C * 4 + hqk * 2 * C * 4) * 2


def roofline_ms(lens, hqk, hv, tflops, copy_gbs) -> float:
    chunks = num_chunks(lens)
    # per chunk and value head: k k^T, T (beta k), T (beta v), q k^T, attn v' (C x C x 128 each)
    # and w h, the state update, (q exp(G)) h (C x 128 x 128 each)
    flops = chunks * hv * 2 * (5 * C * C * K + 3 * C * K * V)
    return 1e3 * max(flops / (tflops * 1e12), min_bytes(lens, hqk, hv) / (copy_gbs * 1e9))


def _pool_call_buffers(x, hv, autocp=True, pool_dtype=torch.float32, per_sequence=None):
    """What our pool-form prefill is called with in a cell: the plan (the planner decides AutoCP
    from the lengths, the head count and the SM count; ``per_sequence`` as ``plan_prefill``'s
    ``cp_per_sequence``), a pool of ``pool_dtype`` holding the cell's initial states at slots 1..N,
    the slots, has-initial-state, the output, and the final states' view."""
    from qla_serving.plan import plan_prefill

    N = len(x["cu"]) - 1
    plan = plan_prefill(x["cu"], device="cuda", num_v_heads=hv, cp_segment_tokens=None if autocp else 0,
                        cp_per_sequence=per_sequence)
    pool = torch.empty(N + 1, hv, V, K, device="cuda", dtype=pool_dtype)
    idx = torch.arange(1, N + 1, device="cuda", dtype=torch.int32)
    has_init = torch.ones(N, dtype=torch.bool, device="cuda")
    out = torch.empty_like(x["v"])
    pool[1:].copy_(x["h0"])  # the state then evolves in place call after call (decays keep it bounded)
    final_state = pool[1:]  # (a view made once: nothing added to the timed call)
    return plan, pool, idx, has_init, out, final_state


def runner_qla(x, hqk, hv, autocp=True, pool_dtype=torch.float32, per_sequence=None):
    from qla_serving.kernels.chunk_prefill import chunk_gated_delta_rule_fwd, warmup

    warmup(hqk, hv, dtype=x["q"].dtype, beta_dtype=x["beta"].dtype, pool_dtype=pool_dtype, use_qk_l2norm=True)
    plan, pool, idx, has_init, out, final_state = _pool_call_buffers(x, hv, autocp, pool_dtype, per_sequence)

    def fn():
        chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=K**-0.5, plan=plan,
                                   state_pool=pool, state_indices=idx, has_initial_state=has_init,
                                   use_qk_l2norm=True, out=out)
        return out, final_state

    return fn


def runner_qla_packed(x, hqk, hv):
    """Ours on the engine's own buffers (vLLM's conv output holding q, k, v; a and b as the two
    halves of one projection, in the activation dtype; ``dt_bias`` too, as vLLM creates it): the
    packed-inputs kernels, whose ``prep`` splits, normalises and gates, so no preparation pass runs
    before them (``qla`` is timed without the one it needs)."""
    from qla_serving.kernels.chunk_prefill import chunk_gated_delta_rule_fwd_packed, warmup

    dtype, T = x["q"].dtype, x["q"].shape[0]
    qkv = torch.cat([x["q"].reshape(T, -1), x["k"].reshape(T, -1), x["v"].reshape(T, -1)], dim=1)
    ab = torch.cat([x["a"], x["b"]], dim=1).to(dtype)
    a, b = ab[:, :hv], ab[:, hv:]
    dt_bias = x["dt_bias"].to(dtype)
    warmup(hqk, hv, dtype=dtype, pool_dtype=torch.float32, packed_gate_dtypes=(x["A_log"].dtype, dtype))
    plan, pool, idx, has_init, out, final_state = _pool_call_buffers(x, hv)

    def fn():
        chunk_gated_delta_rule_fwd_packed(qkv, a, b, x["A_log"], dt_bias, num_qk_heads=hqk, a_stride=2 * hv,
                                          b_stride=2 * hv, scale=K**-0.5, plan=plan, state_pool=pool,
                                          state_indices=idx, has_initial_state=has_init, out=out)
        return out, final_state

    return fn


def _fla_own_path() -> None:
    """FLA's own Triton kernels, not the FlashQLA ones FLA can dispatch to: read when fla first
    imports, so set before any runner that imports fla (directly or through FlashQLA)."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")


def runner_fla(x, hqk, hv):
    _fla_own_path()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v = (t.unsqueeze(0) for t in (x["q"], x["k"], x["v"]))
    g, beta = x["g"].unsqueeze(0), x["beta"].unsqueeze(0)
    cu = x["cu"].to("cuda")
    h0 = x["h0"].transpose(-1, -2).contiguous()  # FLA's [N, HV, K, V]

    def fn():
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=K**-0.5, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=x["cu"])

    return fn


def runner_flashinfer(x, hqk, hv):
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    # FlashInfer 0.6.14 ignores use_qk_l2norm_in_kernel (unnormalised keys make the recurrence
    # overflow): q and k come normalised, as vLLM hands them over
    q, k = (torch.nn.functional.normalize(t.float(), dim=-1).to(t.dtype) for t in (x["q"], x["k"]))
    alpha = torch.exp(x["g"])
    beta = x["beta"].float()
    cu = x["cu"].to("cuda")
    out = torch.empty_like(x["v"])
    state = torch.empty_like(x["h0"])

    def fn():
        return chunk_gated_delta_rule(q, k, x["v"], alpha, beta, scale=K**-0.5, initial_state=x["h0"],
                                      output_final_state=True, cu_seqlens=cu, output=out, output_state=state)

    return fn


def runner_qwen_flashqla(x, hqk, hv):
    _fla_own_path()
    from flash_qla import chunk_gated_delta_rule

    q, k, v = (t.unsqueeze(0) for t in (x["q"], x["k"], x["v"]))
    g, beta = x["g"].unsqueeze(0), x["beta"].unsqueeze(0)
    cu = x["cu"].to("cuda")

    def fn():
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=K**-0.5, initial_state=x["h0"], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu, state_v_first=True)

    return fn


def _failed(e: Exception) -> str:
    """A notes entry's account of a step that raised: its type and the start of its message."""
    return f"failed ({type(e).__name__}: {str(e)[:200]})"


def standard_outputs(impl: str, result) -> tuple[torch.Tensor, torch.Tensor]:
    """What one call of ``impl``'s runner returned, as ``(o [T, HV, V], final state [N, HV, V, K])``."""
    o, state = result
    if impl in ("fla", "qwen-flashqla"):
        o = o[0]  # [1, T, HV, V]: varlen inputs as one batch row
    if impl == "fla":
        state = state.transpose(-1, -2)  # FLA's [N, HV, K, V]
    return o, state


def device_ms(fn, iters: int = 20) -> float:
    """Kernel time per call of ``fn``: the summed durations of the GPU work it launches (torch
    profiler: kernels and copies), averaged over ``iters`` calls after two unmeasured ones. Host
    time, launch gaps and host syncs between the kernels are not in it, so an implementation that
    a CUDA graph cannot capture can be compared with the others on it. Kernels that overlap
    (ours: ``chunk_fwd`` starts during ``prep``'s last blocks) are counted in full."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / iters / 1e3


def check_against_qla(x, hqk, hv, impls) -> list[str]:
    """One call of each of ``impls`` from the cell's initial state, compared with ours (``qla``,
    whose agreement with the float64 recurrence the GPU tests show): the largest difference of
    the output and of the final state, each relative to ours' largest magnitude. Confirms that
    every timed implementation computes the same thing on the same inputs."""
    ref_o, ref_s = (t.float().clone() for t in runner_qla(x, hqk, hv)())
    lines = []
    for impl in impls:
        if impl == "qla":
            continue
        try:
            o, state = standard_outputs(impl, RUNNERS[impl](x, hqk, hv)())
            do = ((o.float() - ref_o).abs().max() / ref_o.abs().max()).item()
            ds = ((state.float() - ref_s).abs().max() / ref_s.abs().max()).item()
            lines.append(f"check {impl} {hqk}/{hv}: output within {do:.1e} of qla's, final state within {ds:.1e}"
                         f" (relative to qla's largest)")
        except Exception as e:
            lines.append(f"check {impl} {hqk}/{hv}: {_failed(e)}")
    return lines


RUNNERS = {"qla": runner_qla, "fla": runner_fla, "flashinfer": runner_flashinfer, "qwen-flashqla": runner_qwen_flashqla,
           "qla-nocp": lambda x, hqk, hv: runner_qla(x, hqk, hv, autocp=False), "qla-packed": runner_qla_packed,
           "qla-per-sequence": lambda x, hqk, hv: runner_qla(x, hqk, hv, per_sequence=True),
           "qla-bf16-state": lambda x, hqk, hv: runner_qla(x, hqk, hv, pool_dtype=torch.bfloat16)}


@contextlib.contextmanager
def swapped_kernels(module, cfg, kernels):
    """Inside the block, ``module``'s compiled ``(prep, chunk_fwd)`` of static config ``cfg``
    are replaced by ``kernels`` (two callables with the kernels' arguments); yields the
    originals and restores them on the way out. ``module`` is
    ``qla_serving.kernels.chunk_prefill`` or a variant of it (``scripts/trace``)."""
    saved = module._kernel_set(cfg)
    module._kernels[cfg] = tuple(kernels)
    try:
        yield saved
    finally:
        module._kernels[cfg] = saved


def kernel_medians(module, cfg, call, iters=20, skip=3) -> dict:
    """Median CUDA-event time of each kernel of ``module`` (``prep``, ``chunk_fwd``) over
    ``iters`` calls of ``call`` after ``skip`` unmeasured ones. ``module`` is
    ``qla_serving.kernels.chunk_prefill`` or a variant of it (``scripts/trace``); ``cfg`` the
    static config whose kernels ``call`` runs."""
    names = ("prep", "chunk_fwd")
    events = {n: [] for n in names}

    def timed(name, kernel):
        def run(*args):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            kernel(*args)
            e.record()
            events[name].append((s, e))
        return run

    with swapped_kernels(module, cfg, [timed(n, k) for n, k in zip(names, module._kernel_set(cfg))]):
        for _ in range(iters + skip):
            call()
        torch.cuda.synchronize()
    return {n: sorted(s.elapsed_time(e) for s, e in ev[skip:])[len(ev[skip:]) // 2] for n, ev in events.items()}


def kernel_times(x, hqk, hv, iters=20) -> dict:
    """Median CUDA-event time of each of our kernels (``prep``, ``chunk_fwd``) in one cell."""
    from qla_serving.kernels import chunk_prefill

    cfg = chunk_prefill.static_config(x["q"], x["v"], x["beta"], torch.empty(0, hv, V, K, device="cuda"), True)
    return kernel_medians(chunk_prefill, cfg, runner_qla(x, hqk, hv), iters)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qla-serving bench prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=common.parse_heads, nargs="*", default=None, help="subset of head configs, e.g. 2/8 16/64")
    ap.add_argument("--batches", type=parse_batch, nargs="*", default=None,
                    help=f"batches, NxLEN or LEN+LEN... (default: {' '.join(BATCHES)})")
    ap.add_argument("--impls", nargs="*", default=IMPLS, choices=IMPLS + EXTRA_IMPLS)
    ap.add_argument("--modes", nargs="*", default=["eager", "graph"], choices=["eager", "graph"])
    ap.add_argument("--iters", type=common.positive_int, default=100)
    ap.add_argument("--out-dir", default=None, help="where the results go (default e2e_bench/results)")
    ap.add_argument("--kernel-times", action="store_true", help="also print our per-kernel times in each cell")
    ap.add_argument("--device-times", action="store_true",
                    help="also each implementation's kernel time per call (torch profiler: the sum of its kernels' durations)")
    ap.add_argument("--check", action="store_true",
                    help="also compare each implementation's output and final state with ours (first batch of each head config)")
    args = ap.parse_args(argv)
    common.require_cuda(ap)
    heads = HEAD_CONFIGS if args.heads is None else args.heads
    batches = BATCHES if args.batches is None else args.batches

    meta = common.machine_meta()
    meta["command"] = " ".join(["qla-serving", "bench", "prefill", *(argv if argv is not None else sys.argv[1:])])
    meta["iters"] = args.iters
    rows, notes = [], []
    path = common.results_path("prefill", meta["gpu"], args.out_dir)

    def write():
        note_text = "\n".join([
            "Rows `floor`: roofline floor of the cell (max of FLOPs / measured bf16 rate and minimal bytes / "
            "measured copy bandwidth); `floor/qla` is the fraction of it reached.",
            "qla, fla and qwen-flashqla include the q/k l2 norm; flashinfer gets q/k normalised, exp(g) and fp32 beta "
            "made outside the timed call.",
            *[f"- {n}" for n in notes]])
        common.write_results(path, meta, rows, ["hqk", "hv", "batch"], [*args.impls, "floor"], notes=note_text)

    for hqk, hv in heads:
        for batch in batches:
            lens = batch_lens(batch)
            torch.manual_seed(0)
            x = make_inputs(lens, hqk, hv)
            cell = dict(op="prefill", hqk=hqk, hv=hv, batch=batch)
            floor = roofline_ms(lens, hqk, hv, meta["bf16_tflops"], meta["copy_gbs"])
            for mode in args.modes:
                rows.append(dict(cell, impl="floor", mode=mode, ms=round(floor, 4)))
            if args.check and batch == batches[0]:
                for line in check_against_qla(x, hqk, hv, args.impls):
                    notes.append(line)
                    print(line, flush=True)
            if args.kernel_times:
                times = kernel_times(x, hqk, hv)
                notes.append(f"qla kernels {hqk}/{hv} {batch}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()))
                print(notes[-1], flush=True)
            for impl in args.impls:
                try:
                    fn = RUNNERS[impl](x, hqk, hv)
                except Exception as e:  # a library missing on this machine: say so, go on
                    notes.append(f"{impl} {hqk}/{hv} {batch}: unavailable ({type(e).__name__}: {e})")
                    continue
                if args.device_times:
                    try:
                        notes.append(f"device time {impl} {hqk}/{hv} {batch}: {device_ms(fn):.4f} ms per call")
                    except Exception as e:
                        notes.append(f"device time {impl} {hqk}/{hv} {batch}: {_failed(e)}")
                    print(notes[-1], flush=True)
                for mode in args.modes:
                    try:
                        ms = common.median_ms(fn, iters=args.iters, graph=(mode == "graph"))
                    except Exception as e:
                        notes.append(f"{impl} {hqk}/{hv} {batch} {mode}: {_failed(e)}")
                        traceback.print_exc(limit=2)
                        torch.cuda.synchronize()
                        continue
                    rows.append(dict(cell, impl=impl, mode=mode, ms=round(ms, 4), **common.gpu_clock_state()))
                    print(f"{hqk}/{hv} {batch:>11} {impl:>10} {mode:>5} {ms:8.3f} ms  (floor {floor:.3f})", flush=True)
                del fn
            del x
            torch.cuda.empty_cache()
            write()  # after every cell: a run cut short still leaves its results

    write()
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
