"""The first long request against the same request sent again, on SGLang's GDN adapter path.

An investigation tool (not run by CI). In a fresh process it does what a just-started SGLang
server does before and during its first requests, on the Qwen3-Next-80B shapes at TP 1 (16/32
GDN heads, bf16, 6 GDN layers): our start-up warm-up (``integrations/sglang/warmup.py``, as
``bind_to_runner`` runs it), SGLang's own warm-up request (a few tokens), then one long
single-sequence extend (8192 tokens: ``begin_batch`` and every layer's ``extend``, then decode
steps) twice, and prints milliseconds per part of request 1 and request 2.

    # CPU: the SGLang venv; kernel launches are no-ops at the launcher (scripts/host_overhead.py's
    # seam: the device decision says SM90, the planner sees 132 SMs), so only host work counts
    ~/.cache/qla-serving/sglang-0.5.23-venv/bin/python scripts/first_request.py
    # GPU (an SM90 machine with the package installed): real launches, synchronised per part,
    # with the CUDA caching allocator's cudaMalloc count and the library kernels set up per part
    python scripts/first_request.py --device cuda
    # either: --no-device-calls warms up as before the start-up op calls (kernel lookups only)

Each request's parts: ``begin_batch`` (the plan), ``layer i`` (the extend, prefill kernels
included on a GPU), ``decode`` (the decode steps together).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
H, HV, D, LAYERS, SLOTS = 16, 32, 128, 6, 160


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (launches stubbed) or cuda")
    parser.add_argument("--tokens", type=int, default=8192, help="the long request's prompt tokens")
    parser.add_argument("--server-warmup-tokens", type=int, default=7, help="SGLang's own warm-up request (0: none)")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--state", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--no-device-calls", action="store_true", help="warm up with kernel lookups only")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "tests" / "sglang")]
    import torch

    cuda = args.device.startswith("cuda")
    dev = torch.device(args.device)
    if not cuda:
        import host_overhead

        torch.set_num_threads(1)
        host_overhead.emulate_sm90()
        print("kernels:", host_overhead.install_noop_kernels())
    from qla_serving.integrations.sglang import warmup
    from qla_serving.kernels import library
    from test_sglang_kernel import extend_batch, make_kernel

    inits = []
    real_init = library.LibraryKernel._ensure_init
    library.LibraryKernel._ensure_init = lambda self, device: inits.append(self.symbol) or real_init(self, device)
    if args.no_device_calls:
        warmup.device_call_steps = lambda cfg, device: []
    pool_dtype = torch.float32 if args.state == "fp32" else torch.bfloat16

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def allocs() -> int:
        return torch.cuda.memory_stats(dev).get("num_device_alloc", 0) if cuda else 0

    # the layers' configuration as SGLang's adapter reads it (dt_bias in the model dtype)
    config = dict(phases={"prefill", "decode"}, num_qk_heads=H, num_v_heads=HV, dtype=torch.bfloat16,
                  pool_dtype=pool_dtype, bias_dtype=torch.bfloat16)
    t = time.perf_counter()
    warmup.warmup_kernels(device=dev if cuda else None, **config)
    if not cuda and not args.no_device_calls:  # on the CPU the device calls run on CPU tensors
        from qla_serving.warmup import device_call_steps

        for _, fn in device_call_steps(warmup.warmup_config(**config), dev):
            fn()
    sync()
    print(f"our warm-up: {1e3 * (time.perf_counter() - t):.1f} ms, library kernels set up: {inits}")
    kernel = make_kernel()
    kernel.num_v_heads = HV
    ssm = torch.zeros(SLOTS, HV, D, D, dtype=pool_dtype, device=dev)
    # the layers' gate parameters as SGLang creates them: A_log float32, dt_bias in the model dtype
    A_log, dt_bias = torch.full((HV,), -1.0, device=dev), torch.zeros(HV, dtype=torch.bfloat16, device=dev)

    def request(tokens: int) -> list[tuple[str, float, int, list]]:
        fb, md, be = extend_batch([tokens], [1])
        md.query_start_loc = md.query_start_loc.to(dev)
        md.mamba_cache_indices = md.mamba_cache_indices.to(dev)
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, tokens, H, D, generator=gen, device=dev).to(torch.bfloat16)
        k = torch.randn(1, tokens, H, D, generator=gen, device=dev).to(torch.bfloat16)
        v = torch.randn(1, tokens, HV, D, generator=gen, device=dev).to(torch.bfloat16)
        g = -torch.rand(1, tokens, HV, generator=gen, device=dev) * 0.1
        beta = torch.rand(1, tokens, HV, generator=gen, device=dev)
        out = torch.empty(1, tokens, HV, D, dtype=torch.bfloat16, device=dev)
        sync()
        parts = []

        def timed(name, fn):
            inits.clear()
            before = allocs()
            t0 = time.perf_counter()
            fn()
            sync()
            parts.append((name, 1e3 * (time.perf_counter() - t0), allocs() - before, list(inits)))

        timed("begin_batch", lambda: kernel.begin_batch(be, fb))
        for i in range(LAYERS):
            timed(f"layer {i}", lambda: kernel.extend(
                q, k, v, g, beta, ssm_states=ssm, cache_indices=md.mamba_cache_indices,
                query_start_loc=md.query_start_loc, output=out, track_state=None, track_chunk_idx=None))

        def decode():
            qd, kd = q[:, :1].contiguous(), k[:, :1].contiguous()
            vd, ab = v[:, :1].contiguous(), torch.zeros(1, HV, dtype=torch.bfloat16, device=dev)
            for _ in range(args.decode_steps):
                for _ in range(LAYERS):
                    kernel.decode(qd, kd, vd, ab, ab, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm,
                                  cache_indices=md.mamba_cache_indices, query_start_loc=md.query_start_loc)

        timed("decode", decode)
        return parts

    if args.server_warmup_tokens:
        parts = request(args.server_warmup_tokens)
        print(f"SGLang's warm-up request ({args.server_warmup_tokens} tokens): {sum(p[1] for p in parts):.1f} ms, "
              f"library kernels set up: {[i for p in parts for i in p[3]]}")
    first, second = request(args.tokens), request(args.tokens)
    plan = kernel._batches[0].plan
    cp = plan.context_parallel
    print(f"{args.tokens}-token request, one sequence: {plan.work_items_cpu.shape[0]} work items "
          f"({'AutoCP ' + str(cp.segment_tokens) + '-token segments' if cp else 'no AutoCP'}); device {dev}; "
          f"device calls at start-up: {'no' if args.no_device_calls else 'yes'}")
    print("| part | request 1 ms | request 2 ms | cudaMalloc 1 | cudaMalloc 2 | kernels set up in 1 |")
    print("|---|---|---|---|---|---|")
    for (name, t1, a1, i1), (_, t2, a2, _) in zip(first, second):
        print(f"| {name} | {t1:.3f} | {t2:.3f} | {a1} | {a2} | {', '.join(i1) or '-'} |")
    total1, total2 = sum(p[1] for p in first), sum(p[1] for p in second)
    print(f"| total | {total1:.3f} | {total2:.3f} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
