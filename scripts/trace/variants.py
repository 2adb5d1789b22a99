"""Variants of the prefill kernels (kernels/chunk_prefill_program.py and chunk_prefill.py) for measurement only: clock64 timelines and baselines.

A variant is the kernel module's source with text inserted at anchors (statements of the kernel
bodies), imported from a temporary file. The stamps write ``clock64()`` of one thread per
warpgroup (``chunk_fwd``) or per block (``prep``) into an extra int64 tensor; the median
intervals between stamps say where a chunk's or a block's cycles go. Stamps are scheduled by
ptxas like any other instruction: a stamp right after a wgmma may be read before the wgmma's
wait, so read intervals across a product as "issued .. next stamp".

If an anchor is gone (the kernel changed), ``AnchorError`` names it: update the table here.
"""

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the TileLang programs, then the host side that loads and launches them (one module here)
KERNEL_FILES = ("kernels/chunk_prefill_program.py", "kernels/chunk_prefill.py")

# chunk_fwd: (anchor, slot, occurrence, before). Slots 0-15 the state role (stamped by thread 0
# of each of its two warpgroups: the later write wins), 16-23 the P role, 24 the producer.
FWD_STAMPS = [
    ("T.barrier_wait(full[st], (c // 2) % 2)", 0, 1, False),
    ("T.wgmma_gemm(Sb_f, k_s[st, :, :], x_f", 1, 1, True),
    ("T.barrier_wait(p_ready[st], (c // 2) % 2)", 2, 1, False),
    ("T.wait_wgmma(0)", 3, 1, False),
    ("T.wgmma_gemm(xb_f, t_s[st, :, :], u_f", 4, 1, False),
    ("T.wait_wgmma(0)", 5, 2, False),
    ("T.wgmma_gemm(ub_f, k_s[st, :, :], S_f", 6, 1, True),
    ("T.wait_wgmma(0)", 7, 3, False),
    ("T.barrier_arrive(p_free[st])", 8, 1, False),
    ("T.barrier_arrive(empty[st])", 9, 1, False),
    ("out_bulk_store(o_s, ob_f, o, cs - C, hv, tx, wg)", 10, 1, False),
    ("T.barrier_wait(full[st], (c // 2) % 2)", 16, 2, False),
    ("T.barrier_wait(p_free[st], ((c // 2) % 2) ^ 1)", 17, 1, False),
    ("T.wait_wgmma(0)", 18, 4, False),  # the P role's q k^T
    ("T.copy(pb_f, p_s[st, :, :])", 19, 1, False),
    ("T.barrier_arrive(p_ready[st])", 20, 1, False),
    ("T.barrier_wait(empty[st], ((c // 2) % 2) ^ 1)", 24, 1, False),
]
FWD_NAMES = {0: "S full", 1: "S cast", 2: "S p_ready", 3: "S X,O done", 4: "S U issued", 5: "S U done",
             6: "S casts", 7: "S update done", 8: "S ob", 9: "S empty", 10: "S last output stored",
             16: "P full", 17: "P p_free", 18: "P qk done", 19: "P stored", 20: "P ready",
             24: "L empty"}
FWD_TC, FWD_NSLOT = 24, 32  # chunks traced per work item, slots per chunk

# prep: (anchor, slot, before, indent); slot i is PREP_NAMES[i]. Per-block phase latencies
# include the time the SM spends on the other three resident blocks: a phase's share is not
# what removing it saves (taking the L2-norm pass out of three blocks in four cut its median
# from 6.7k to 0.5k cycles and left the kernel's time unchanged).
PREP_STAMPS = [
    ("k_s = T.alloc_shared((C, K), dt)", 0, True, " " * 12),
    ("T.cumsum(src=g_s, dst=G_s, dim=0)", 2, False, None), ("# ---- A = strict_lower", 3, True, None),
    ("T.barrier_wait(loaded, 0)", 1, False, None),
    ("T.gemm(k_s, k_s, A_f, transpose_B=True, clear_accum=True)", 5, False, None),
    ("for i, j in T.Parallel(C, C):  # (A_f is the wgmma accumulator", 4, True, None),
    ("# ---- inverse of the 16x16 diagonal blocks", 6, True, None), ("# ---- merge: (I + A)", 7, True, None),
    ("T.gemm(Dinv_s, N_s, P_f, clear_accum=True)  # P", 8, False, None),
    ("T.gemm(Mh_f, X_s, P_f, clear_accum=True)  # P^2", 9, False, None),
    ("T.gemm(Mh2_f, W_s, P_f, clear_accum=True)  # R = (I - P)(I + P^2)", 10, False, None),
    ("T.gemm(Mh_f, Dinv_s, P_f, clear_accum=True)  # T = R D^-1", 11, False, None),
    ("T.tma_copy(Tb_s, t_beta[ic, hv, :, :])", 12, False, None),
    ("    return prep", 13, True, " " * 12),
]
PREP_NAMES = ["start", "k loaded", "cumsum", "gates stored", "q/k norms", "kkT issued", "A stored", "Dinv",
              "P issued", "P^2 issued", "R issued", "T issued", "T stored", "end"]
PREP_NSLOT = 16


class AnchorError(LookupError):
    pass


def joined(sources: list[str]) -> str:
    """The prefill kernel module as one source: the programs' file, then the host file without its
    import of them (revisions before the split: their one file as it is)."""
    return "".join(re.sub(r"from \.chunk_prefill_program import \([^)]*\)\n", "", s) for s in sources)


def tree_source() -> str:
    """The checkout's prefill kernel module, joined (:func:`joined`)."""
    texts = []
    for name in KERNEL_FILES:
        with open(os.path.join(ROOT, name)) as f:
            texts.append(f.read())
    return joined(texts)


def _absolute_imports(src: str) -> str:
    return (src.replace("from ..constants import", "from qla_serving.constants import")
            .replace("from . import library", "from qla_serving.kernels import library")
            # revisions before qla_serving.constants
            .replace("from ..ops.gated_delta_rule.context_parallel import",
                     "from qla_serving.ops.gated_delta_rule.context_parallel import")
            .replace("from .configs import PREFILL_CONFIGS", "from qla_serving.kernels.configs import PREFILL_CONFIGS"))


def _insert(body: str, anchor: str, line: str, nth: int = 1, before: bool = False, indent: str | None = None) -> str:
    i = -1
    for _ in range(nth):
        i = body.find(anchor, i + 1)
        if i < 0:
            raise AnchorError(f"anchor not found (occurrence {nth}): {anchor!r}")
    ls = body.rfind("\n", 0, i) + 1  # 0 on the first line
    ind = indent if indent is not None else body[ls:i]
    if before:
        pos = ls
    else:  # after the statement, which may continue over parenthesised lines
        depth, j = 0, ls
        while True:
            ch = body[j]
            depth += ch in "([" and 1 or ch in ")]" and -1 or 0
            if ch == "\n" and depth == 0:
                pos = j + 1
                break
            j += 1
    return body[:pos] + f"{ind}{line}\n" + body[pos:]


def _stamped(body: str, macro: str, stamps, call: str) -> str:
    """``body`` (one kernel builder) with the stamp macro before its prim_func and a stamp call
    at each (anchor, slot, occurrence, before, indent); a missing anchor skips its stamp."""
    body = body.replace("    @T.prim_func\n", macro + "\n    @T.prim_func\n", 1)
    for anchor, slot, nth, before, indent in stamps:
        try:
            body = _insert(body, anchor, call.format(slot), nth=nth, before=before, indent=indent)
        except AnchorError as e:
            print(f"variants: stamp {slot} skipped: {e}", file=sys.stderr)
    return body


def cell_heads(cell: str) -> tuple[int, int]:
    """``HQK:HV[:...]`` -> (hqk, hv)."""
    hqk, hv = cell.split(":")[:2]
    return int(hqk), int(hv)


def cell_setup(cell: str):
    """``HQK:HV:BATCH[:nocp]`` -> (hqk, hv, inputs, plan): the bench's inputs (seed 0) and the
    planner's plan for them (AutoCP off with ``nocp``)."""
    import torch

    from qla_serving.bench.prefill import batch_lens, make_inputs
    from qla_serving.plan import plan_prefill

    hqk, hv = cell_heads(cell)
    parts = cell.split(":")
    batch, nocp = parts[2], len(parts) > 3 and parts[3] == "nocp"
    torch.manual_seed(0)
    x = make_inputs(batch_lens(batch), hqk, hv)
    plan = plan_prefill(x["cu"], device="cuda", num_v_heads=hv, cp_segment_tokens=0 if nocp else None)
    return hqk, hv, x, plan


def op_call(mod, x, plan, hv: int):
    """``mod``'s prefill op on these inputs, in place on a fresh pool: (call, out, pool)."""
    import functools

    import torch

    n, k = plan.num_seqs, x["q"].shape[-1]
    pool = torch.zeros(n + 1, hv, x["v"].shape[-1], k, device="cuda")
    out = torch.empty_like(x["v"])
    call = functools.partial(mod.chunk_gated_delta_rule_fwd, x["q"], x["k"], x["v"], x["g"], x["beta"],
                             scale=k**-0.5, plan=plan, state_pool=pool,
                             state_indices=torch.arange(1, n + 1, device="cuda", dtype=torch.int32),
                             has_initial_state=torch.ones(n, dtype=torch.bool, device="cuda"),
                             use_qk_l2norm=True, out=out)
    return call, out, pool


def run_traced(mod, cell: str):
    """Three calls of a stamped module's op on ``cell``'s inputs: (chunk_fwd's stamps of chunks
    4..23 of every block that reached chunk 23, ``[blocks, 20, FWD_NSLOT]``; prep's raw stamps,
    ``[chunks x value heads, PREP_NSLOT]``), both int64 clock64 values on the CPU."""
    import torch

    hqk, hv, x, plan = cell_setup(cell)
    nw, nc = plan.work_items.shape[0], plan.num_chunks
    mod.TRACE["fwd"] = torch.zeros(nw * hv * mod.FWD_TC * mod.FWD_NSLOT, dtype=torch.int64, device="cuda")
    mod.TRACE["prep"] = torch.zeros(nc * hv * mod.PREP_NSLOT, dtype=torch.int64, device="cuda")
    mod.warmup(hqk, hv)
    call, _, _ = op_call(mod, x, plan, hv)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    fwd = mod.TRACE["fwd"].view(nw * hv, mod.FWD_TC, mod.FWD_NSLOT)[:, 4:, :].cpu()
    return fwd[(fwd[:, :, 0] > 0).all(1)], mod.TRACE["prep"].view(nc * hv, mod.PREP_NSLOT).cpu()


def traced_source(src: str | None = None) -> str:
    """The kernel module with both kernels stamped; ``TRACE['fwd']`` / ``TRACE['prep']`` are the buffers."""
    if src is None:
        src = tree_source()
    src = _absolute_imports(src)
    src = src.replace("import threading\n", f"import threading\nTRACE = {{}}\nFWD_TC, FWD_NSLOT, PREP_NSLOT = {FWD_TC}, {FWD_NSLOT}, {PREP_NSLOT}\n", 1)
    a, b = src.index("def _build_prep"), src.index("def _build_chunk_fwd")
    c = src.index("# Compilation and cache")
    prep, fwd = src[a:b], src[b:c]
    prep = prep.replace("        qk_rnorm: T.Tensor((NC, H, 2, C), f32),\n    ):",
                        "        qk_rnorm: T.Tensor((NC, H, 2, C), f32),\n        trace: T.Tensor((NTR,), \"int64\"),\n    ):")
    prep = prep.replace('    BLK = 16', '    NTR = T.dynamic("ntrace", "int64")\n    BLK = 16', 1)
    prep = _stamped(prep, '''    @T.macro
    def stamp(trace, ic, hv, slot):
        if T.get_thread_binding() == 0:
            trace[(T.cast(ic, "int64") * HV + hv) * PREP_NSLOT + slot] = T.call_extern("int64", "clock64")
''', [(a, s, 1, b, i) for a, s, b, i in PREP_STAMPS], "stamp(trace, ic, hv, {})")
    fwd = fwd.replace("        o: T.Tensor((NT, HV, V), dt),\n    ):",
                      "        o: T.Tensor((NT, HV, V), dt),\n        trace: T.Tensor((NTR,), \"int64\"),\n    ):")
    fwd = fwd.replace('    NCK = T.dynamic("num_ckpt_rows", "int64")\n',
                      '    NCK = T.dynamic("num_ckpt_rows", "int64")\n    NTR = T.dynamic("ntrace", "int64")\n')
    fwd = _stamped(fwd, '''    @T.macro
    def stamp(trace, wi, hv, c, slot):
        if c < FWD_TC:
            if T.get_thread_binding() % WG == 0:
                trace[((T.cast(wi, "int64") * HV + hv) * FWD_TC + c) * FWD_NSLOT + slot] = T.call_extern("int64", "clock64")
''', [(a, s, n, b, None) for a, s, n, b in FWD_STAMPS], "stamp(trace, wi, hv, c, {})")
    tail = src[c:]
    tail = re.sub(r"(\n    prep\([^)]*t_beta, g_cum, qk_rnorm)\)", r"\1, TRACE['prep'])", tail, count=1)
    tail = tail.replace("float(LOG_DECAY_THRESHOLD), float(scale), out)", "float(LOG_DECAY_THRESHOLD), float(scale), out, TRACE['fwd'])")
    return src[:a] + prep + fwd + tail


def baseline_source(rev: str, nregs: str | None = None) -> str:
    """The kernel module as of git revision ``rev`` (or a file holding it, e.g. from
    ``git show REV:kernels/chunk_prefill_program.py REV:kernels/chunk_prefill.py > base.py``, or
    ``git show REV:kernels/chunk_prefill.py`` for a revision before the split); ``nregs``
    ("248,112,128,24") pins its role registers."""
    if os.path.isfile(rev):  # a saved copy: the GPU machine's tree has no git history
        with open(rev) as f:
            src = joined([f.read()])
    else:
        texts = []
        for name in KERNEL_FILES:
            got = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{name}"], capture_output=True, text=True)
            if got.returncode == 0:
                texts.append(got.stdout)
        if not texts:
            raise FileNotFoundError(f"revision {rev} has none of {KERNEL_FILES}")
        src = joined(texts)
    src = _absolute_imports(src)
    if nregs:
        src = src.replace("from qla_serving.kernels.configs import PREFILL_CONFIGS",
                          "from qla_serving.kernels.configs import PREFILL_CONFIGS as _PC\n"
                          f"PREFILL_CONFIGS = dict(_PC, fwd_role_nregs=({nregs}))")
    return src


def load(name: str, src: str):
    """Import ``src`` as module ``name`` (TileLang's disk cache keys on the generated kernels)."""
    path = os.path.join(tempfile.mkdtemp(prefix="qla-variant-"), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
