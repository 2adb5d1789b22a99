"""`qla-serving bench decode`: the fused decode step, ours vs FLA vs FlashInfer, one run.

For each head configuration (H q/k heads / HV value heads), state dtype and batch size the
three implementations get the same inputs and pool:

* ``qla``: :func:`qla_serving.kernels.decode.gated_delta_rule_decode_fwd`, pool in place.
* ``fla``: FLA's ``fused_recurrent_gated_delta_rule`` with the gate in the kernel
  (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``, ``state_v_first``); it has no pool
  indexing, so it reads a contiguous ``[N, HV, V, K]`` block and writes a new float32 state.
* ``flashinfer``: ``gated_delta_rule_decode_pretranspose`` in pool mode (``initial_state`` +
  ``initial_state_indices``), in place.

Times are CUDA-graph replays (engines run decode under graphs), median over ``--iters``.
When one call's state would fit in L2, a graph holds ``R`` calls on disjoint slots (``R``
sized so they cover 3x the L2) and the time is divided by ``R``, so no number is an L2
number. GB/s counts the state read and written once in the pool's dtype plus the
activations, the same bytes for every implementation, and is compared with the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

import torch

from . import common

K = V = 128
DEFAULT_BATCHES = (1, 8, 32, 64, 128, 256, 512)
DEFAULT_HEADS = ("16/64", "16/48", "16/32", "2/8")
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("qla", "fla", "flashinfer")
MAX_REPS = 64


def _impl_fns(impls, q, k, v, a, b, A_log, dt_bias, pool, idx_sets, scale, N):
    """One callable per implementation: fn(r) runs the step on index set r."""
    fns = {}
    if "qla" in impls:
        from qla_serving.kernels.decode import gated_delta_rule_decode_fwd

        out = torch.empty_like(v)

        def qla(r):
            gated_delta_rule_decode_fwd(q, k, v, a, b, A_log, dt_bias, state_pool=pool, state_indices=idx_sets[r],
                                        scale=scale, use_qk_l2norm=True, out=out)
            return out

        fns["qla"] = qla
    if "fla" in impls:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        def fla(r):
            # FLA takes per-sequence states: a contiguous block of N slots of the same pool.
            h0 = pool[r * N:(r + 1) * N]
            o, _ = fused_recurrent_gated_delta_rule(
                q, k, v, g=a, beta=b, scale=scale, initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True, state_v_first=True)
            return o

        fns["fla"] = fla
    if "flashinfer" in impls:
        from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose

        out_fi = torch.empty_like(v)

        def flashinfer(r):
            o, _ = gated_delta_rule_decode_pretranspose(
                q, k, v, None, A_log, a, dt_bias, b, scale=scale, output=out_fi, use_qk_l2norm=True,
                initial_state=pool, initial_state_indices=idx_sets[r])
            return o

        fns["flashinfer"] = flashinfer
    return fns


def _cross_check(fns, pool, idx_sets, N) -> dict:
    """Every implementation from the same starting state: outputs relative to qla's."""
    idx = idx_sets[0].long()
    saved = pool[idx].clone()
    saved_block = pool[:N].clone()
    outs = {}
    for name, fn in fns.items():
        pool[idx] = saved
        pool[:N] = saved_block
        if name == "fla":
            pool[:N] = saved  # FLA reads the block; give it the same states as the indexed slots
        outs[name] = fn(0).float().clone()
        pool[idx] = saved
        pool[:N] = saved_block
    ref = outs.get("qla")
    if ref is None:
        return {}
    return {name: float((o - ref).norm() / ref.norm()) for name, o in outs.items() if name != "qla"}


def run(batches, heads, states, impls, iters, log=print) -> tuple[list[dict], list[str]]:
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows, notes = [], []
    max_batch = max(batches)
    for H, HV in heads:
        for state_name in states:
            dtype = STATE_DTYPES[state_name]
            esize = torch.finfo(dtype).bits // 8
            # One pool per configuration for every batch: FlashInfer's fp32 kernel is compiled per pool shape.
            num_slots = max(max_batch, 2 * 8)
            pool = (torch.randn(num_slots, HV, V, K, device=dev) * 0.1).to(dtype)
            A_log = torch.empty(HV, device=dev).uniform_(0, math.log(16))
            dt_bias = torch.randn(HV, device=dev) * 0.5
            for N in batches:
                state_bytes = N * HV * V * K * esize
                reps = max(1, min(MAX_REPS, math.ceil(3 * l2 / state_bytes), num_slots // N))
                perm = torch.randperm(num_slots, device=dev)
                idx_sets = [perm[r * N:(r + 1) * N].int().contiguous() for r in range(reps)]
                q = torch.randn(N, 1, H, K, device=dev, dtype=torch.bfloat16)
                k = torch.randn(N, 1, H, K, device=dev, dtype=torch.bfloat16)
                v = torch.randn(N, 1, HV, V, device=dev, dtype=torch.bfloat16)
                a = torch.randn(N, 1, HV, device=dev, dtype=torch.bfloat16)
                b = torch.randn(N, 1, HV, device=dev, dtype=torch.bfloat16)
                scale = K**-0.5
                act_bytes = 2 * (2 * N * H * K + 2 * N * HV * V + 2 * N * HV) + 4 * N
                nbytes = 2 * state_bytes + act_bytes
                fns = _impl_fns(impls, q, k, v, a, b, A_log, dt_bias, pool, idx_sets, scale, N)
                if N == min(batches):
                    errs = _cross_check(fns, pool, idx_sets, N)
                    notes.append(f"- check H/HV={H}/{HV} {state_name} N={N}: output vs qla " +
                                 ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
                for name, fn in fns.items():
                    def many(fn=fn):
                        for r in range(reps):
                            fn(r)

                    try:
                        ms = common.median_ms(many, graph=True, warmup=5, iters=iters) / reps
                    except Exception as e:  # a competitor that cannot run this cell: record why
                        notes.append(f"- {name} H/HV={H}/{HV} {state_name} N={N}: failed: {type(e).__name__}: {e}")
                        continue
                    rows.append({"op": "decode", "hqk": H, "hv": HV, "batch": str(N), "state": state_name,
                                 "impl": name, "mode": "graph", "ms": round(ms, 5), "reps": reps,
                                 "gbs": round(nbytes / (ms * 1e-3) / 1e9, 1)})
                    log(f"{H}/{HV} {state_name} N={N:4d} {name:10s} {ms * 1e3:9.2f} us "
                        f"{rows[-1]['gbs']:8.1f} GB/s (reps {reps})")
            del pool
            torch.cuda.empty_cache()
    return rows, notes


def summary(rows: list[dict], copy_gbs: float) -> list[str]:
    """GB/s table and the issue's targets, cell by cell."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["hqk"], r["hv"], r["state"], int(r["batch"])), {})[r["impl"]] = r
    lines = ["", f"GB/s (copy {copy_gbs:.0f} GB/s measured in this run):", "",
             "| hqk | hv | state | batch | qla GB/s | % copy | fla GB/s | flashinfer GB/s | qla/fla | qla/fi |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    misses = []
    for (h, hv, st, n), c in sorted(cells.items()):
        q = c.get("qla")
        if q is None:
            continue
        fla, fi = c.get("fla"), c.get("flashinfer")
        r_fla = fla["ms"] / q["ms"] if fla else None
        r_fi = fi["ms"] / q["ms"] if fi else None
        frac = q["gbs"] / copy_gbs
        lines.append(f"| {h} | {hv} | {st} | {n} | {q['gbs']:.0f} | {100 * frac:.1f}% | "
                     f"{fla['gbs'] if fla else '–'} | {fi['gbs'] if fi else '–'} | "
                     f"{f'{r_fla:.2f}x' if r_fla else '–'} | {f'{r_fi:.2f}x' if r_fi else '–'} |")
        if n >= 64 and r_fi is not None and r_fi < 0.95:
            misses.append(f"{h}/{hv} {st} N={n}: {r_fi:.2f}x FlashInfer (< 0.95)")
        if n >= 64 and r_fla is not None and r_fla < 1.3:
            misses.append(f"{h}/{hv} {st} N={n}: {r_fla:.2f}x FLA (< 1.3)")
        if n >= 256 and st == "fp32" and frac < 0.9:
            misses.append(f"{h}/{hv} {st} N={n}: {100 * frac:.1f}% of copy (< 90%)")
    lines += ["", "Targets missed: " + ("none" if not misses else "; ".join(misses))]
    return lines


def sweep_tiles(tiles, batches, heads, states, iters) -> list[str]:
    """Time our kernel under other (rows_per_cta, threads) tiles: the evidence for DECODE_CONFIGS."""
    from qla_serving.kernels import configs

    import copy

    saved = copy.deepcopy(configs.DECODE_CONFIGS)
    lines = ["| tile | hqk/hv | state | batch | us | GB/s |", "|---|---|---|---|---|---|"]
    try:
        for rows_per_cta, threads in tiles:
            # Force the tile for every batch size.
            for name in ("float32", "bfloat16"):
                configs.DECODE_CONFIGS[name].update(rows_per_cta=rows_per_cta, threads=threads,
                                                    small_rows_per_cta=rows_per_cta, small_threads=threads)
            rows, _ = run(batches, heads, states, ["qla"], iters, log=lambda s: None)
            for r in rows:
                lines.append(f"| {rows_per_cta}x{threads} | {r['hqk']}/{r['hv']} | {r['state']} | {r['batch']} | "
                             f"{r['ms'] * 1e3:.2f} | {r['gbs']:.0f} |")
    finally:
        configs.DECODE_CONFIGS.clear()
        configs.DECODE_CONFIGS.update(saved)
    return lines


def _parse_tile(text: str) -> tuple[int, int]:
    rows, threads = (int(x) for x in text.split("x"))
    return rows, threads


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="qla-serving bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES), help="batch sizes")
    ap.add_argument("--heads", type=common.parse_heads, nargs="+", default=[common.parse_heads(h) for h in DEFAULT_HEADS],
                    help="H/HV pairs, e.g. 16/64 2/8")
    ap.add_argument("--state", choices=list(STATE_DTYPES), nargs="+", default=list(STATE_DTYPES))
    ap.add_argument("--impls", choices=IMPLS, nargs="+", default=list(IMPLS))
    ap.add_argument("--iters", type=int, default=100, help="timed graph replays per cell")
    ap.add_argument("--out-dir", default=None, help="results directory (default e2e_bench/results)")
    ap.add_argument("--sweep-tiles", type=_parse_tile, nargs="+", default=None, metavar="ROWSxTHREADS",
                    help="instead of the comparison, time our kernel with these tiles (printed, not saved)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench decode needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.sweep_tiles:
        print("\n".join(sweep_tiles(args.sweep_tiles, args.batch, args.heads, args.state, args.iters)))
        return 0
    impls = []
    for name in args.impls:  # a competitor that is not installed is left out, and said so
        mod = {"qla": "tilelang", "fla": "fla", "flashinfer": "flashinfer"}[name]
        try:
            __import__(mod)
            impls.append(name)
        except Exception as e:
            print(f"skipping {name}: cannot import {mod}: {e}", file=sys.stderr)
    meta = common.machine_meta()
    meta["command"] = " ".join(shlex.quote(x) for x in ["qla-serving", "bench", "decode", *argv])
    print(f"{meta['gpu']}: copy {meta['copy_gbs']} GB/s", flush=True)
    rows, notes = run(args.batch, args.heads, args.state, impls, args.iters, log=lambda s: print(s, flush=True))
    lines = summary(rows, meta["copy_gbs"])
    path = common.results_path("decode", meta["gpu"], args.out_dir)
    common.write_results(path, meta, rows, ["hqk", "hv", "state", "batch"], [i for i in IMPLS if i in impls],
                         notes="\n".join(notes + lines))
    print("\n".join(lines))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
