"""AutoCP segment lengths side by side: graph medians of our op on one cell's inputs with the
planner's choice and with forced segment lengths (0: no split), alternated over rounds so that
clock drift hits every length alike.

    python scripts/trace/cp_sweep.py 16:64:24576+8192 --segs auto,2752,8192,0 [--rounds 3]

Cells are HQK:HV:BATCH as in variants.cell_setup. Measurement only: the benchmark of record is
`qla-serving bench prefill`.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("cells", nargs="+")
    ap.add_argument("--segs", default="auto,0", help="comma-separated: auto (the planner), 0 (no split) or tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    from qla_serving.kernels import chunk_prefill as m

    from qla_serving.bench.common import median_ms
    from qla_serving.plan import plan_prefill

    for cell in args.cells:
        hqk, hv, x, _ = variants.cell_setup(cell)
        m.warmup(hqk, hv)
        calls = {}
        for seg in args.segs.split(","):
            plan = plan_prefill(x["cu"], device="cuda", num_v_heads=hv, cp_segment_tokens=None if seg == "auto" else int(seg))
            cp = plan.context_parallel
            label = f"{seg}" + ("" if cp is None else f" ({cp.segment_tokens} x {max(len(s) for s in cp.segments)})")
            calls[label] = variants.op_call(m, x, plan, hv)[0]
        times = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, f in calls.items():
                times[k].append(median_ms(f, iters=args.iters, graph=True))
        for k, t in times.items():
            print(f"{cell} seg {k:22s} graph median {statistics.median(t):.4f} ms  rounds {' '.join(f'{v:.4f}' for v in t)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
