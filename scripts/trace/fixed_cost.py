"""Graph-mode time of the prefill op and of each kernel alone, for 8 sequences of 64..4096
tokens: the intercept of time against chunks per sequence is the per-call fixed cost.

    python scripts/trace/fixed_cost.py 16:16 4:16 [--compile-only]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import variants


def main(argv):
    heads = [a for a in argv if not a.startswith("--")]
    from qla_serving.kernels import chunk_prefill as m
    if "--compile-only" in argv:
        for h in heads:
            m.warmup(*variants.cell_heads(h))
        return 0
    from qla_serving.bench.common import median_ms
    from qla_serving.bench.prefill import swapped_kernels

    def noop(*args):
        return None

    for h in heads:
        for L in (64, 256, 1024, 4096):
            cell = f"{h}:8x{L}:nocp"
            _, hv, x, plan = variants.cell_setup(cell)
            f, _out, pool = variants.op_call(m, x, plan, hv)
            cfg = m.static_config(x["q"], x["v"], x["beta"], pool, True)
            prep, fwd = m._kernel_set(cfg)
            t = {}
            for name, ks in (("op", (prep, fwd)), ("prep", (prep, noop)), ("fwd", (noop, fwd)), ("none", (noop, noop))):
                with swapped_kernels(m, cfg, ks):
                    t[name] = median_ms(f, graph=True, iters=50) * 1000
            print(cell, " ".join(f"{k} {v:.1f}us" for k, v in t.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
