"""qla-serving: check the ops on this machine, show what runs where, run the benchmarks.

    qla-serving check          # ops vs the float64 oracle on a Qwen3.5-27B-shaped batch
    qla-serving info           # versions, device, and which path each op takes
    qla-serving compile        # build the kernels of given GDN configurations ahead of serving
    qla-serving bench prefill  # GPU benchmarks (see qla_serving.bench)
    qla-serving bench decode
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pathlib
import sys
import time
from dataclasses import dataclass

import torch

from . import backend
from .bench.common import parse_heads, positive_int, rel_err
from .constants import HEAD_DIM, MAX_DECODE_TOKENS
from .ops.gated_delta_rule import chunk_gated_delta_rule_pool, gated_delta_rule_decode
from .ops.gated_delta_rule.naive import gdn_gate_ref, recurrent_decode_ref, recurrent_gated_delta_rule_ref
from .plan import plan_prefill

# Qwen3.5-27B at TP1: 16 q/k heads, 48 value heads, head dims 128.
DEFAULT_HEADS = (16, 48)
# A mixed varlen batch: the chunk-boundary cases and a longer prompt.
DEFAULT_LENGTHS = (1, 63, 64, 65, 129, 400)


@dataclass
class CheckRow:
    op: str
    case: str
    path: str
    rel_err: float
    tol: float
    ms: float

    @property
    def ok(self) -> bool:
        return self.rel_err == self.rel_err and self.rel_err <= self.tol  # NaN fails


def _qwen_gates(T: int, HV: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gates as a Qwen GDN layer makes them: A_log in [-4, 1.5], a and b from activations."""
    A_log = torch.empty(HV, device=device).uniform_(-4, 1.5)
    dt_bias = torch.randn(HV, device=device) * 0.5
    g, beta = gdn_gate_ref(torch.randn(T, HV, device=device), torch.randn(T, HV, device=device),
                           A_log, dt_bias, dtype=torch.float32)
    return g, beta


def _path(op: str, device: torch.device, dtype: torch.dtype) -> str:
    reason = backend.unsupported_reason(device, HEAD_DIM, HEAD_DIM, dtype)
    return "reference (PyTorch)" if reason else "TileLang kernels"


def _timed(fn, warm_up=None):
    """``fn()``'s result and milliseconds; ``warm_up`` runs first, untimed, on scratch copies of
    the buffers ``fn`` updates in place, so the time excludes the kernels' first compile."""
    if warm_up is not None:
        warm_up()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, (time.perf_counter() - t0) * 1e3


def run_check(heads=DEFAULT_HEADS, lengths=DEFAULT_LENGTHS, device=None, dtype=None, seed=0) -> list[CheckRow]:
    """Run prefill, prefill with checkpoints and decode on the best path; compare with the oracle."""
    H, HV = heads
    K = V = HEAD_DIM
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rows = []

    # Prefill in the serving form: scattered pool slots, some sequences with an initial state.
    N, T = len(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = torch.randn(T, H, K, generator=gen).to(device, dtype)
    k = torch.randn(T, H, K, generator=gen).to(device, dtype)
    v = torch.randn(T, HV, V, generator=gen).to(device, dtype)
    g, beta = _qwen_gates(T, HV, device)
    num_slots = 3 * N + 16  # room for the decode batch below too
    pool = (torch.randn(num_slots, HV, V, K, generator=gen) * 0.1).to(device)
    slots = torch.randperm(num_slots, generator=gen)[:N].to(device, torch.int32)
    has_init = (torch.arange(N) % 2 == 0).to(device)
    init = torch.where(has_init.view(-1, 1, 1, 1), pool[slots.long()], 0.0)
    ckpt_every = 64
    plan = plan_prefill(cu, device=device, checkpoint_every=ckpt_every)
    ckpts = torch.empty(plan.num_checkpoints, HV, V, K, device=device)
    pool_before = pool.clone()
    def prefill(pool_, ckpts_):
        return chunk_gated_delta_rule_pool(q, k, v, g, beta, pool_, slots, has_initial_state=has_init,
                                           use_qk_l2norm_in_kernel=True, plan=plan, checkpoints=ckpts_)

    o, ms = _timed(lambda: prefill(pool, ckpts), warm_up=lambda: prefill(pool.clone(), ckpts.clone()))
    o_ref, final_ref, ckpt_ref = recurrent_gated_delta_rule_ref(
        q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), initial_state=init.cpu(), cu_seqlens=cu,
        use_qk_l2norm=True, checkpoint_every=ckpt_every)
    case = f"{H}/{HV} heads, lengths {'+'.join(map(str, lengths))}"
    path = _path("prefill", device, dtype)
    rows.append(CheckRow("prefill o", case, path, rel_err(o, o_ref), tol, ms))
    rows.append(CheckRow("prefill final state", case, path, rel_err(pool[slots.long()], final_ref), tol, 0.0))
    rows.append(CheckRow("prefill checkpoints", f"every {ckpt_every} tokens, {plan.num_checkpoints} states",
                         path, rel_err(ckpts, ckpt_ref), tol, 0.0))
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots.long().cpu()] = False
    untouched = bool(torch.equal(pool.cpu()[others], pool_before.cpu()[others]))
    rows.append(CheckRow("prefill other slots", "bit-identical", path, 0.0 if untouched else float("inf"), 0.0, 0.0))

    # Decode: one token and a 4-token speculative verify, with a padded row.
    for T_dec in (1, 4):
        n = 8
        qd = torch.randn(n, T_dec, H, K, generator=gen).to(device, dtype)
        kd = torch.randn(n, T_dec, H, K, generator=gen).to(device, dtype)
        vd = torch.randn(n, T_dec, HV, V, generator=gen).to(device, dtype)
        a = torch.randn(n, T_dec, HV, generator=gen).to(device, dtype)
        b = torch.randn(n, T_dec, HV, generator=gen).to(device, dtype)
        A_log = torch.empty(HV).uniform_(-4, 1.5, generator=gen).to(device)
        dt_bias = (torch.randn(HV, generator=gen) * 0.5).to(device)
        idx = torch.randperm(num_slots, generator=gen)[:n].to(device, torch.int32)
        idx[-1] = -1
        live = idx >= 0
        init = torch.where(live.view(-1, 1, 1, 1), pool[idx.long().clamp(min=0)], 0.0)
        inter = torch.empty(n, T_dec, HV, V, K, device=device)
        def decode(pool_, inter_, qd=qd, kd=kd, vd=vd, a=a, b=b, A_log=A_log, dt_bias=dt_bias, idx=idx):
            return gated_delta_rule_decode(qd, kd, vd, a, b, A_log, dt_bias, pool_, idx, intermediate_states=inter_)

        od, ms = _timed(lambda: decode(pool, inter), warm_up=lambda: decode(pool.clone(), inter.clone()))
        o_ref, s_ref = recurrent_decode_ref(qd.cpu(), kd.cpu(), vd.cpu(), a.cpu(), b.cpu(), A_log.cpu(),
                                            dt_bias.cpu(), init.cpu())
        lv = live.cpu()
        case = f"{H}/{HV} heads, {n} seqs x {T_dec} token(s), 1 padded"
        path = _path("decode", device, dtype)
        rows.append(CheckRow("decode o", case, path, rel_err(od.cpu()[lv], o_ref[lv]), tol, ms))
        rows.append(CheckRow("decode states", case, path, rel_err(inter.cpu()[lv], s_ref[lv]), tol, 0.0))
    return rows


def format_table(rows: list[CheckRow]) -> str:
    head = ("op", "case", "path", "rel err", "tol", "ms (warm)", "")
    body = [(r.op, r.case, r.path, f"{r.rel_err:.2e}", f"{r.tol:.0e}", f"{r.ms:.1f}" if r.ms else "",
             "ok" if r.ok else "FAIL") for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*b) for b in body)])


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"1,63,64"`` or ``"1+63+64"`` (the form the check's table prints) -> positive lengths."""
    parts = text.replace("+", ",").split(",")
    try:
        lengths = tuple(int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths {text!r}: expected positive integers, e.g. 1,63,64 or 1+63+64") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"lengths {text!r}: every sequence needs at least one token")
    return lengths


def parse_device(text: str) -> torch.device:
    """``cpu`` or ``cuda[:N]``, refused when this torch cannot reach it."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"device {text!r}: expected cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device {text!r}: expected cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"device {text!r}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"device {text!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def _cmd_check(args) -> int:
    lengths = args.lengths
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[args.dtype]
    device = args.device
    print(f"qla-serving check: torch {torch.__version__}, device {device or ('cuda' if torch.cuda.is_available() else 'cpu')}")
    rows = run_check(args.heads, lengths, device, dtype, args.seed)
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _cmd_info(args) -> int:
    from .bench.common import library_versions

    for name, version in library_versions().items():
        print(f"{name:20s} {version}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        print(f"{'gpu':20s} {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    from .kernels import library

    for lib in library.libraries():
        print(f"{'kernel library':20s} {lib.path} ({len(lib.manifest['kernels'])} kernels, "
              f"built with TileLang {lib.manifest.get('built_with', {}).get('tilelang', '?')})")
    if not library.libraries():
        print(f"{'kernel library':20s} none ({library.describe_search_path()})")
    tl = library.tilelang_unsupported_reason()
    print(f"{'TileLang compiles':20s} {'yes' if tl is None else 'no: ' + tl}")
    reason = backend.unsupported_reason(device, HEAD_DIM, HEAD_DIM, torch.bfloat16)
    print(f"{f'path (bf16, K=V={HEAD_DIM})':20s} {'kernels' if reason is None else 'PyTorch reference: ' + reason}")
    return 0


def _cmd_compile(args) -> int:
    from . import compile as qc

    if args.shipped:
        configs = qc.shipped_configs()
        what = "the shipped set"
    else:
        heads = list(args.heads or [])
        if args.model_config:
            try:
                full = qc.model_heads(args.model_config)
                heads += [qc.per_rank(full, tp) for tp in args.tp]
            except (OSError, ValueError) as e:
                print(f"qla-serving compile: {e}", file=sys.stderr)
                return 2
        configs = qc.plan_configs(heads, engine=args.engine, dtypes=args.dtype, states=args.state,
                                  verify_tokens=args.verify_tokens, gate_dtype=args.gate_dtype,
                                  bias_dtype=args.bias_dtype)
        what = f"{args.engine}, heads {', '.join(f'{h}/{hv}' for h, hv in dict.fromkeys(heads))}"
    out = args.out or qc.default_library_dir(args.shipped)
    print(f"qla-serving compile: {len(configs)} configuration(s) ({what}) into {out}")
    try:
        manifest = qc.build(configs, out, jobs=args.jobs)
    except RuntimeError as e:
        print(f"qla-serving compile: {e}", file=sys.stderr)
        return 1
    size = (pathlib.Path(out) / manifest["library"]).stat().st_size
    print(f"qla-serving compile: {len(manifest['kernels'])} kernels, {manifest['library']} {size / 2**20:.1f} MiB")
    return 0


def _cmd_bench(args) -> int:
    module = importlib.import_module(f"qla_serving.bench.{args.op}")
    return int(module.main(args.rest) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qla-serving", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check", help="run the ops on the best available path and compare with the float64 oracle")
    p.add_argument("--heads", type=parse_heads, default=DEFAULT_HEADS, help="Hqk/Hv (default: Qwen3.5-27B TP1)")
    p.add_argument("--lengths", type=parse_lengths, default=DEFAULT_LENGTHS,
                   help="prefill sequence lengths, 1,63,64 or 1+63+64 (default: %(default)s)")
    p.add_argument("--device", type=parse_device, default=None, help="cpu or cuda[:N] (default: cuda when present)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="activation dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_cmd_check)
    p = sub.add_parser("info", help="versions, device and the path each op takes")
    p.set_defaults(fn=_cmd_info)
    p = sub.add_parser(
        "compile", help="build the kernels of given GDN configurations ahead of serving",
        description="Build every kernel a served model needs into a precompiled kernel library that the package "
                    "loads without TileLang (default directory: the user's cache, which the package searches), "
                    "so the engine compiles nothing at start-up. Needs TileLang 0.1.15 and nvcc, not a GPU.")
    p.add_argument("--shipped", action="store_true",
                   help="the set the wheel ships (kernels/configs.py SHIPPED_CONFIGS), into the package")
    p.add_argument("--out", help="library directory (replaced)")
    p.add_argument("--jobs", type=positive_int, default=None, help="parallel build processes (default: CPU count)")
    p.add_argument("--heads", type=parse_heads, nargs="+", help="GDN heads per rank, Hqk/Hv")
    p.add_argument("--model-config", help="a hybrid Qwen config.json; with --tp, its heads per rank")
    p.add_argument("--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes (with --model-config)")
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm",
                   help="the engine whose way of handing the kernels their inputs to compile for")
    p.add_argument("--dtype", choices=["bf16", "fp16"], nargs="+", default=["bf16"], help="activation dtypes")
    p.add_argument("--state", choices=["fp32", "bf16"], nargs="+", default=["fp32", "bf16"],
                   help="recurrent-state pool dtypes")
    p.add_argument("--verify-tokens", type=int, nargs="*", default=[],
                   help="tokens per sequence in speculative verify (num_speculative_tokens + 1)")
    p.add_argument("--gate-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of the layers' A_log (as the checkpoint stores it)")
    p.add_argument("--bias-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="dtype of the layers' dt_bias (default: --gate-dtype)")
    p.set_defaults(fn=_cmd_compile)
    p = sub.add_parser(
        "bench", help="GPU benchmarks, side by side with FLA and FlashInfer",
        description="Kernel benchmarks (results and a markdown table in e2e_bench/results/). "
                    "prefill: the chunked prefill grid against FLA, FlashInfer and FlashQLA; "
                    "decode: the decode step against FLA and FlashInfer; "
                    "summary: read prefill results back and print the prefill targets. "
                    "Options follow the benchmark's name: qla-serving bench OP --help.")
    p.add_argument("op", choices=["prefill", "decode", "summary"], help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's own options")
    p.set_defaults(fn=_cmd_bench)
    args = parser.parse_args(argv)
    if args.cmd == "compile":
        if not args.heads and not args.model_config and not args.shipped:
            parser.error("compile: give --heads, --model-config or --shipped")
        if any(t < 1 for t in args.tp):
            parser.error(f"compile: --tp {args.tp}: each must be >= 1")
        if any(not 1 <= t <= MAX_DECODE_TOKENS for t in args.verify_tokens):
            parser.error(f"compile: --verify-tokens {args.verify_tokens}: each must be in 1..{MAX_DECODE_TOKENS}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
