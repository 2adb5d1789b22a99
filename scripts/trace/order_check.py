"""Does running FLA or FlashInfer in the same process change our op's time? One cell, graph
medians of ``qla`` measured before and after each other implementation, with the GPU's SM clock
and temperature (nvidia-smi) after each measurement.

    python scripts/trace/order_check.py 16/64 24576+8192 [--order qla,fla,qla,flashinfer,qla]
"""

import argparse
import sys

GPU_STATE = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("heads")
    ap.add_argument("batch")
    ap.add_argument("--order", default="qla,fla,qla,flashinfer,qla")
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args(argv)
    import torch

    from qla_serving.bench import common
    from qla_serving.bench.prefill import RUNNERS, batch_lens, make_inputs

    hqk, hv = (int(x) for x in args.heads.split("/"))
    torch.manual_seed(0)
    x = make_inputs(batch_lens(args.batch), hqk, hv)
    for impl in args.order.split(","):
        fn = RUNNERS[impl](x, hqk, hv)
        ms = common.median_ms(fn, iters=args.iters, graph=True)
        state = common.nvidia_smi_query(GPU_STATE)
        print(f"{args.heads} {args.batch} {impl:10s} graph {ms:.4f} ms | sm MHz, mem MHz, C, W, throttle: {state}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
