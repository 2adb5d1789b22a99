"""A/B of the prefill op (prep + chunk_fwd) between a git revision's kernels and the working tree's.

    python scripts/trace/ab_time.py --base 58c49bc [--base-nregs 240,120,128,24] 16:64:8x4096 2:8:1x8192:nocp

--base is a git revision, or a file with that revision's prefill kernel module (the GPU machine's
copy of the tree has no history: `git show REV:kernels/chunk_prefill_program.py
REV:kernels/chunk_prefill.py > f.py`, or `git show REV:kernels/chunk_prefill.py > f.py` before the
two were split).

Same inputs, same plan, CUDA-event medians of 50 calls after 5 (eager, or CUDA-graph replays with
--graph; --rounds N repeats them, alternating which goes first, and takes the median over the
rounds); prints each time, the speed-up
and the largest output difference (--kernels: each kernel's median too, `prep` and
`chunk_fwd`). --compile-only fills TileLang's cache here. Measurement only: the benchmark of
record is `qla-serving bench prefill`.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--base-nregs", default=None, help="role registers of the base (its configs.py may differ)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="also each kernel's median time")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (as the benchmark's graph rows)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed rounds per cell, alternating which goes first; medians over rounds")
    ap.add_argument("cells", nargs="+")
    args = ap.parse_args(argv)
    base = variants.load("qla_prefill_base", variants.baseline_source(args.base, args.base_nregs))
    from qla_serving.kernels import chunk_prefill as head
    if args.compile_only:
        for cell in args.cells:
            hqk, hv = variants.cell_heads(cell)
            base.warmup(hqk, hv)
            head.warmup(hqk, hv)
        return 0
    import torch

    from qla_serving.bench.common import median_ms
    from qla_serving.bench.prefill import kernel_medians

    for cell in args.cells:
        hqk, hv, x, plan = variants.cell_setup(cell)
        calls = {}
        for name, m in (("base", base), ("tree", head)):
            m.warmup(hqk, hv)
            calls[name] = (m, *variants.op_call(m, x, plan, hv))
        times = {"base": [], "tree": []}
        for r in range(args.rounds):
            # alternate which goes first: the second of two back-to-back measurements tends to run
            # at a lower clock (the H200's power cap), which one order alone would book to one side
            for name in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                times[name].append(median_ms(calls[name][1], warmup=5, iters=50, graph=args.graph))
        res = []
        for name in ("base", "tree"):
            m, f, out, pool = calls[name]
            pool.zero_()  # the outputs compared come from one call on a zero initial state
            f()
            torch.cuda.synchronize()
            kt = ""
            if args.kernels:
                cfg = m.static_config(x["q"], x["v"], x["beta"], pool, True)
                kt = ", ".join(f"{n} {t:.4f}" for n, t in kernel_medians(m, cfg, f, iters=30, skip=0).items())
            res.append((statistics.median(times[name]), out.clone(), kt))
        (tb, ob, kb), (th, oh, kh) = res
        rounds = "" if args.rounds == 1 else " (rounds: " + ", ".join(
            f"{b / t:.3f}x" for b, t in zip(times["base"], times["tree"])) + ")"
        print(f"{cell}: base {tb:.4f} ms, tree {th:.4f} ms, speed-up {tb / th:.3f}x{rounds}, "
              f"max |out diff| {(oh.float() - ob.float()).abs().max().item():.2e}"
              + (f"; base {kb}; tree {kh}" if args.kernels else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
