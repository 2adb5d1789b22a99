"""Does a TileLang kernel with ``pdl_sync`` start before the kernel ahead of it finishes?

Two spin kernels of ~15 us (H200): the first triggers its dependents at once, the second
spins before ``pdl_sync``. Back to back in one CUDA graph they take about as long as one if
programmatic dependent launch is in effect, about as long as both if not. Measurement only
(H100/H200).

    python scripts/trace/pdl_check.py [--compile-only]
"""

import sys


def kernels():
    import tilelang
    import tilelang.language as T
    from tilelang.cuda.language import pdl_sync, pdl_trigger
    from tvm.target import Target

    @T.prim_func
    def first(y: T.Tensor((8, 128), "float32"), iters: T.int32):
        with T.Kernel(8, threads=128) as bx:
            pdl_trigger()
            acc = T.alloc_var("float32")
            acc = 1.0
            for _ in T.serial(iters):
                acc = acc * 0.9999999 + 1.0e-7
            y[bx, T.get_thread_binding()] = acc

    @T.prim_func
    def second(y: T.Tensor((8, 128), "float32"), z: T.Tensor((8, 128), "float32"), iters: T.int32):
        with T.Kernel(8, threads=128) as bx:
            acc = T.alloc_var("float32")
            acc = 1.0
            for _ in T.serial(iters):
                acc = acc * 0.9999999 + 1.0e-7
            pdl_sync()
            z[bx, T.get_thread_binding()] = acc + y[bx, T.get_thread_binding()]

    tgt = Target({"kind": "cuda", "arch": "sm_90a"})
    return tilelang.compile(first, target=tgt), tilelang.compile(second, target=tgt)


def main(argv):
    a, b = kernels()
    if "--compile-only" in argv:
        return 0
    import torch

    from qla_serving.bench.common import median_ms

    y = torch.zeros(8, 128, device="cuda")
    z = torch.zeros_like(y)
    n = 15000
    ta = median_ms(lambda: a(y, n), graph=True) * 1e3
    tb = median_ms(lambda: b(y, z, n), graph=True) * 1e3
    tab = median_ms(lambda: (a(y, n), b(y, z, n)), graph=True) * 1e3
    print(f"first {ta:.1f} us, second {tb:.1f} us, back to back {tab:.1f} us: "
          f"{'overlapped (PDL in effect)' if tab < 0.8 * (ta + tb) else 'serial (no PDL)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
