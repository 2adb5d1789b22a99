"""`qla-serving bench decode`: the fused decode step, ours vs FLA vs FlashInfer, one run.

For each head configuration (H q/k heads / HV value heads), state dtype and batch size every
implementation gets the same inputs (same values) and the same pool slots:

* ``qla``: :func:`qla_serving.kernels.decode.gated_delta_rule_decode_fwd`, pool in place.
* ``qla-packed`` (on request): the same kernel as vLLM's layer calls it, reading q/k/v as column
  ranges of the packed ``[N, 2*H*K + HV*V]`` conv output and a, b as the halves of one
  ``[N, 2*HV]`` gate projection, in place.
* ``qla-split`` (on request): the layer's former path from the same packed inputs: q, k, v, a and
  b copied apart, the slots mapped with ``torch.where``, then the kernel (what the in-place read
  saves, inside one graph).
* ``fla``: FLA's fused recurrent decode as the engines call it: the FLA-derived Triton kernel
  ``fused_recurrent_gated_delta_rule_packed_decode`` that vLLM 0.26 runs for every pure decode
  batch (``VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE``, on by default) and SGLang 0.5.23's
  Triton GDN backend runs as ``packed_decode`` (the same kernel): q/k/v packed in one
  ``[N, 2*H*K + HV*V]`` tensor, gate and beta computed in the kernel, state pool plus
  ``ssm_state_indices``, updated in place. FLA 0.6.0's own ``fused_recurrent_gated_delta_rule``
  has no pool indexing, so the engines carry this kernel themselves; it is imported from an
  installed vLLM, or loaded from vLLM's unmodified source files (``--engine-fla DIR``).
* ``fla-gating`` (on request): vLLM's ``fused_sigmoid_gating_delta_rule_update``, its decode
  kernel for batches that mix prefill, decode or speculative tokens (pool + indices, in place).
* ``fla-unindexed``: FLA 0.6.0's ``fused_recurrent_gated_delta_rule`` called directly (gate in
  the kernel, ``state_v_first``): it reads a contiguous ``[N, HV, V, K]`` block and writes a
  new float32 state, so it skips the pool indirection no engine can skip. Kept for reference.
* ``flashinfer``: ``gated_delta_rule_decode_pretranspose`` in pool mode (``initial_state`` +
  ``initial_state_indices``), in place.

Slot 0 is never used: vLLM's kernels treat index 0 as its null block and skip the row.

Times are CUDA-graph replays (engines run decode under graphs), median over ``--iters``.
When one call's state would fit in L2, a graph holds ``R`` calls on disjoint slots (``R``
sized so they cover 3x the L2) and the time is divided by ``R``, so no number is an L2
number. GB/s counts the state read and written once in the pool's dtype plus the
activations, the same bytes for every implementation, and is compared with the copy
bandwidth measured in the same run. Each configuration is checked against the float64
oracle (output and updated state) at the smallest batch and at the first batch >= 64.

``--sweep-tiles`` times our kernel alone under candidate tiles (``DecodeTile`` text, e.g.
``32x64 64x128l16 32x64b8``) over ``--sweep-heads/--sweep-state/--sweep-batch``, checks each
against the oracle, prints the table and the best tile per cell, and writes
``<date>-<gpu>-decode-tiles.{json,md}``: the evidence for ``DECODE_CONFIGS``.
``--also-bench`` then runs the comparison in the same process.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import shlex
import sys
import time
import types

import torch

from ..constants import HEAD_DIM
from . import common

K = V = HEAD_DIM
DEFAULT_BATCHES = (1, 8, 32, 64, 128, 256, 512)
DEFAULT_HEADS = ("16/64", "16/48", "16/32", "2/8")
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ("qla", "qla-packed", "qla-split", "fla", "fla-gating", "fla-unindexed", "flashinfer")
DEFAULT_IMPLS = ("qla", "fla", "fla-unindexed", "flashinfer")
IN_PLACE = {"qla", "qla-packed", "qla-split", "fla", "fla-gating", "flashinfer"}  # update the pool slots at the indices
MAX_REPS = 64
CHECK_BATCH = 64  # besides the smallest batch, the first batch >= this is checked (large tiles)
# Tolerances of our kernel against the float64 oracle (bf16 output; state in the pool dtype).
OUT_TOL = 1e-2
STATE_TOL = {"fp32": 1e-4, "bf16": 1e-2}
DEFAULT_SWEEP_HEADS = ("16/64", "2/8")
DEFAULT_SWEEP_BATCHES = (64, 256, 512)
ENGINE_FLA_FILES = ("fused_recurrent.py", "fused_sigmoid_gating.py")
ENGINE_FLA_ENV = "QLA_BENCH_ENGINE_FLA"  # default for --engine-fla


class EngineFla:
    """The engines' FLA decode kernels: ``packed_decode`` and ``sigmoid_gating``, plus where
    they came from (``label``)."""

    def __init__(self, packed_decode, sigmoid_gating, label: str):
        self.packed_decode = packed_decode
        self.sigmoid_gating = sigmoid_gating
        self.label = label


def _load_vllm_fla_sources(directory: pathlib.Path) -> EngineFla:
    """Load vLLM's ``third_party/flash_linear_attention/ops`` files from ``directory`` unmodified.

    They import ``vllm.triton_utils`` (``tl``, ``triton``) and ``.op`` (``exp``); without vLLM
    installed those two names are provided here, with vLLM's default (``tl.exp``, no
    ``FLA_USE_FAST_OPS``), and removed again once the files are loaded.
    """
    missing = [f for f in ENGINE_FLA_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--engine-fla {directory}: missing {', '.join(missing)} (copy them from "
            f"vllm/third_party/flash_linear_attention/ops of the vLLM version to compare)"
        )
    import triton
    import triton.language as tl

    pkg_name = "_qla_bench_engine_fla"
    pkg = types.ModuleType(pkg_name)
    pkg.__path__ = [str(directory)]
    op = types.ModuleType(pkg_name + ".op")
    op.exp = tl.exp
    stubs = {pkg_name: pkg, pkg_name + ".op": op}
    had_vllm = "vllm" in sys.modules
    try:
        importlib.import_module("vllm.triton_utils")
    except ImportError:
        if not had_vllm:  # a failed import can leave a namespace package named vllm behind
            sys.modules.pop("vllm", None)
        vllm = types.ModuleType("vllm")
        vllm.__path__ = []
        triton_utils = types.ModuleType("vllm.triton_utils")
        triton_utils.tl, triton_utils.triton = tl, triton
        stubs.update({"vllm": vllm, "vllm.triton_utils": triton_utils})
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        mods = {}
        for fname in ENGINE_FLA_FILES:
            name = f"{pkg_name}.{fname[:-3]}"
            spec = importlib.util.spec_from_file_location(name, directory / fname)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            mods[fname] = mod
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    digest = hashlib.sha256(b"".join((directory / f).read_bytes() for f in ENGINE_FLA_FILES)).hexdigest()[:12]
    return EngineFla(
        mods["fused_recurrent.py"].fused_recurrent_gated_delta_rule_packed_decode,
        mods["fused_sigmoid_gating.py"].fused_sigmoid_gating_delta_rule_update,
        f"vLLM FLA ops loaded from {directory.name}/ (sha256 {digest})",
    )


def load_engine_fla(directory: str | os.PathLike | None) -> EngineFla:
    """The engines' FLA decode kernels: from an installed vLLM, else from ``directory``."""
    try:
        from vllm.third_party.flash_linear_attention.ops import fused_recurrent, fused_sigmoid_gating

        version = importlib.metadata.version("vllm")
        return EngineFla(
            fused_recurrent.fused_recurrent_gated_delta_rule_packed_decode,
            fused_sigmoid_gating.fused_sigmoid_gating_delta_rule_update,
            f"vLLM {version} third_party/flash_linear_attention (installed)",
        )
    except Exception as e:
        if not directory:
            raise ImportError(
                f"vLLM's FLA ops are not importable ({type(e).__name__}: {e}); pass --engine-fla DIR "
                f"(or set {ENGINE_FLA_ENV}) with vLLM's {' and '.join(ENGINE_FLA_FILES)}"
            ) from None
    return _load_vllm_fla_sources(pathlib.Path(directory))


def _impl_fns(impls, q, k, v, a, b, A_log, dt_bias, pool, idx_sets, scale, N, engine):
    """One callable per implementation: fn(r) runs the step on index set r and returns
    ``(output [N, 1, HV, V], new states or None when they went to the pool in place)``."""
    fns = {}
    HV = v.shape[2]
    if "qla" in impls:
        from qla_serving.kernels.decode import gated_delta_rule_decode_fwd

        out = torch.empty_like(v)

        def qla(r):
            gated_delta_rule_decode_fwd(
                q,
                k,
                v,
                a,
                b,
                A_log,
                dt_bias,
                state_pool=pool,
                state_indices=idx_sets[r],
                scale=scale,
                use_qk_l2norm=True,
                out=out,
            )
            return out, None

        fns["qla"] = qla
    if {"fla", "qla-packed", "qla-split"} & set(impls):
        # The engines' layout: q, k, v of one token side by side in one row (same values as ours).
        mixed_qkv = torch.cat([q.reshape(N, -1), k.reshape(N, -1), v.reshape(N, -1)], dim=1)
    if "qla-packed" in impls or "qla-split" in impls:
        from qla_serving.kernels.decode import gated_delta_rule_decode_fwd

        H, K_ = q.shape[2], q.shape[3]
        ba = torch.cat([b.reshape(N, HV), a.reshape(N, HV)], dim=1)
        qp, kp, vp = (x.view(N, 1, -1, K_) for x in mixed_qkv.split([H * K_, H * K_, HV * K_], dim=-1))
        bp, ap = (x.view(N, 1, HV) for x in ba.chunk(2, dim=-1))
        out_p = torch.empty_like(v)

        def packed(r):
            gated_delta_rule_decode_fwd(qp, kp, vp, ap, bp, A_log, dt_bias, state_pool=pool,
                                        state_indices=idx_sets[r], scale=scale, use_qk_l2norm=True, out=out_p)
            return out_p, None

        def split(r):
            idx = idx_sets[r]
            gated_delta_rule_decode_fwd(qp.contiguous(), kp.contiguous(), vp.contiguous(), ap.contiguous(),
                                        bp.contiguous(), A_log, dt_bias, state_pool=pool,
                                        state_indices=torch.where(idx >= 0, idx, -1), scale=scale,
                                        use_qk_l2norm=True, out=out_p)
            return out_p, None

        if "qla-packed" in impls:
            fns["qla-packed"] = packed
        if "qla-split" in impls:
            fns["qla-split"] = split
    if "fla" in impls:
        a2, b2 = a.reshape(N, HV), b.reshape(N, HV)
        out_fla = torch.empty_like(v)

        def fla(r):
            engine.packed_decode(
                mixed_qkv=mixed_qkv,
                a=a2,
                b=b2,
                A_log=A_log,
                dt_bias=dt_bias,
                scale=scale,
                initial_state=pool,
                out=out_fla,
                ssm_state_indices=idx_sets[r],
                use_qk_l2norm_in_kernel=True,
            )
            return out_fla, None

        fns["fla"] = fla
    if "fla-gating" in impls:
        # As vLLM calls it for decode rows: tokens flattened into one varlen batch of length-1 sequences.
        cu_seqlens = torch.arange(N + 1, device=q.device, dtype=torch.int32)
        q1, k1, v1 = (
            q.reshape(1, N, *q.shape[2:]),
            k.reshape(1, N, *k.shape[2:]),
            v.reshape(1, N, *v.shape[2:]),
        )
        a2, b2 = a.reshape(N, HV), b.reshape(N, HV)

        def fla_gating(r):
            o, _ = engine.sigmoid_gating(
                A_log=A_log,
                a=a2,
                b=b2,
                dt_bias=dt_bias,
                q=q1,
                k=k1,
                v=v1,
                scale=scale,
                initial_state=pool,
                inplace_final_state=True,
                cu_seqlens=cu_seqlens,
                ssm_state_indices=idx_sets[r],
                use_qk_l2norm_in_kernel=True,
            )
            return o.view(N, 1, HV, -1), None

        fns["fla-gating"] = fla_gating
    if "fla-unindexed" in impls:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        def fla_unindexed(r):
            # No pool indexing: a contiguous block of N slots of the same pool.
            h0 = pool[r * N : (r + 1) * N]
            o, ht = fused_recurrent_gated_delta_rule(
                q,
                k,
                v,
                g=a,
                beta=b,
                scale=scale,
                initial_state=h0,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True,
                A_log=A_log,
                dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True,
                state_v_first=True,
            )
            return o, ht

        fns["fla-unindexed"] = fla_unindexed
    if "flashinfer" in impls:
        from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose

        out_fi = torch.empty_like(v)

        def flashinfer(r):
            o, _ = gated_delta_rule_decode_pretranspose(
                q,
                k,
                v,
                None,
                A_log,
                a,
                dt_bias,
                b,
                scale=scale,
                output=out_fi,
                use_qk_l2norm=True,
                initial_state=pool,
                initial_state_indices=idx_sets[r],
            )
            return o, None

        fns["flashinfer"] = flashinfer
    return fns



def _check(fns, pool, idx_sets, N, inputs, scale) -> dict:
    """Every implementation from the same starting states against the float64 oracle:
    ``{impl: (output rel. error, state rel. error)}``; the pool is left as it was."""
    from qla_serving.ops.gated_delta_rule.naive import recurrent_decode_ref

    idx = idx_sets[0].long()
    saved = pool[idx].clone()
    saved_block = pool[:N].clone()
    o_ref, st_ref = recurrent_decode_ref(*inputs, saved, scale=scale, use_qk_l2norm=True)
    errs = {}
    for name, fn in fns.items():
        pool[:N] = saved_block
        pool[idx] = saved
        if name == "fla-unindexed":
            pool[:N] = saved  # it reads the block; give it the states of the indexed slots
        o, st = fn(0)
        torch.cuda.synchronize()
        errs[name] = (common.rel_err(o, o_ref), common.rel_err(pool[idx] if st is None else st, st_ref[:, -1]))
    pool[:N] = saved_block
    pool[idx] = saved
    del o_ref, st_ref
    return errs


def _check_line(H, HV, state_name, N, errs) -> tuple[str, bool]:
    """A notes line, and whether our kernel passed (output and state within tolerance)."""
    ok = True
    if "qla" in errs:
        ok = errs["qla"][0] < OUT_TOL and errs["qla"][1] < STATE_TOL[state_name]
    text = ", ".join(f"{n} out {e[0]:.1e} state {e[1]:.1e}" for n, e in errs.items())
    return f"- check H/HV={H}/{HV} {state_name} N={N} vs float64 oracle: {text}" + (
        "" if ok else " — QLA FAILS"
    ), ok


def run(batches, heads, states, impls, iters, log=print, engine=None) -> tuple[list[dict], list[str]]:
    """Time ``impls`` over the grid; returns result rows and notes (oracle checks, failures)."""
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows, notes = [], []
    max_batch = max(batches)
    check_batches = {min(batches)} | {min([n for n in batches if n >= CHECK_BATCH], default=min(batches))}
    for H, HV in heads:
        for state_name in states:
            dtype = STATE_DTYPES[state_name]
            esize = torch.finfo(dtype).bits // 8
            # One pool per configuration for every batch: FlashInfer's fp32 kernel is compiled per
            # pool shape. Slot 0 stays unused (vLLM's null block).
            num_slots = max(max_batch, 2 * 8) + 1
            pool = (torch.randn(num_slots, HV, V, K, device=dev) * 0.1).to(dtype)
            A_log = torch.empty(HV, device=dev).uniform_(0, math.log(16))
            dt_bias = torch.randn(HV, device=dev) * 0.5
            for N in batches:
                state_bytes = N * HV * V * K * esize
                reps = max(1, min(MAX_REPS, math.ceil(3 * l2 / state_bytes), (num_slots - 1) // N))
                perm = torch.randperm(num_slots - 1, device=dev) + 1
                idx_sets = [perm[r * N : (r + 1) * N].int().contiguous() for r in range(reps)]
                q = torch.randn(N, 1, H, K, device=dev, dtype=torch.bfloat16)
                k = torch.randn(N, 1, H, K, device=dev, dtype=torch.bfloat16)
                v = torch.randn(N, 1, HV, V, device=dev, dtype=torch.bfloat16)
                a = torch.randn(N, 1, HV, device=dev, dtype=torch.bfloat16)
                b = torch.randn(N, 1, HV, device=dev, dtype=torch.bfloat16)
                scale = K**-0.5
                act_bytes = 2 * (2 * N * H * K + 2 * N * HV * V + 2 * N * HV) + 4 * N
                nbytes = 2 * state_bytes + act_bytes
                fns = _impl_fns(impls, q, k, v, a, b, A_log, dt_bias, pool, idx_sets, scale, N, engine)
                if N in check_batches:
                    try:
                        errs = _check(fns, pool, idx_sets, N, (q, k, v, a, b, A_log, dt_bias), scale)
                        notes.append(_check_line(H, HV, state_name, N, errs)[0])
                    except Exception as e:  # record it and go on timing
                        notes.append(
                            f"- check H/HV={H}/{HV} {state_name} N={N}: failed: {type(e).__name__}: {e}"
                        )
                for name, fn in fns.items():

                    def many(fn=fn, reps=reps):
                        for r in range(reps):
                            fn(r)

                    try:
                        ms = common.median_ms(many, graph=True, warmup=5, iters=iters) / reps
                    except Exception as e:  # a competitor that cannot run this cell: record why
                        notes.append(
                            f"- {name} H/HV={H}/{HV} {state_name} N={N}: failed: {type(e).__name__}: {e}"
                        )
                        continue
                    rows.append(
                        {
                            "op": "decode",
                            "hqk": H,
                            "hv": HV,
                            "batch": str(N),
                            "state": state_name,
                            "impl": name,
                            "mode": "graph",
                            "ms": round(ms, 5),
                            "reps": reps,
                            "gbs": round(nbytes / (ms * 1e-3) / 1e9, 1),
                        }
                    )
                    log(
                        f"{H}/{HV} {state_name} N={N:4d} {name:13s} {ms * 1e3:9.2f} us "
                        f"{rows[-1]['gbs']:8.1f} GB/s (reps {reps})"
                    )
                # A plain copy of the same state bytes, timed the same way (reps copies per graph,
                # fresh buffers each): what the memory system gives a launch of this size, fixed
                # launch and tail costs included. Context for the copy target, which is judged
                # against the large copy of the run's header.
                src = torch.empty(reps, state_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
                dst = torch.empty_like(src)

                def copies(src=src, dst=dst, reps=reps):
                    # an elementwise kernel, not copy_(): a graph-captured copy_ of >= 512 MiB becomes
                    # a memcpy node, far below the bandwidth a kernel gets (commit 8b7c720 has the numbers)
                    for r in range(reps):
                        torch.mul(src[r], 1.0, out=dst[r])

                ms = common.median_ms(copies, graph=True, warmup=5, iters=iters) / reps
                rows.append({"op": "decode", "hqk": H, "hv": HV, "batch": str(N), "state": state_name,
                             "impl": "copy", "mode": "graph", "ms": round(ms, 5), "reps": reps,
                             "gbs": round(2 * state_bytes / (ms * 1e-3) / 1e9, 1)})
                del src, dst
            del pool
            torch.cuda.empty_cache()
    return rows, notes


def summary(rows: list[dict], copy_gbs: float) -> list[str]:
    """GB/s table and the decode targets (against FlashInfer, FLA and the copy), cell by cell (the FLA
    target is the engines' call)."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["hqk"], r["hv"], r["state"], int(r["batch"])), {})[r["impl"]] = r
    others = [i for i in IMPLS if i != "qla" and any(i in c for c in cells.values())]
    lines = [
        "",
        (
            f"GB/s (copy {copy_gbs:.0f} GB/s measured in this run, 2 GiB; '% same-size copy': against a "
            "copy of the cell's state bytes timed like the cell, launch and tail costs included; the "
            "target is judged against the first):"
        ),
        "",
        "| hqk | hv | state | batch | qla GB/s | % copy | % same-size copy | "
        + " | ".join(f"{i} GB/s" for i in others)
        + " | "
        + " | ".join(f"qla/{i}" for i in others)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * (2 * len(others)),
    ]
    misses = []
    for (h, hv, st, n), c in sorted(cells.items()):
        q = c.get("qla")
        if q is None:
            continue
        ratio = {i: c[i]["ms"] / q["ms"] for i in others if i in c}
        frac = q["gbs"] / copy_gbs
        same = f"{100 * q['gbs'] / c['copy']['gbs']:.1f}%" if "copy" in c else "–"
        lines.append(
            f"| {h} | {hv} | {st} | {n} | {q['gbs']:.0f} | {100 * frac:.1f}% | {same} | "
            + " | ".join(f"{c[i]['gbs']:.0f}" if i in c else "–" for i in others)
            + " | "
            + " | ".join(f"{ratio[i]:.2f}x" if i in ratio else "–" for i in others)
            + " |"
        )
        if n >= 64 and "flashinfer" in ratio and ratio["flashinfer"] < 0.95:
            misses.append(f"{h}/{hv} {st} N={n}: {ratio['flashinfer']:.2f}x FlashInfer (< 0.95)")
        if n >= 64 and "fla" in ratio and ratio["fla"] < 1.3:
            misses.append(f"{h}/{hv} {st} N={n}: {ratio['fla']:.2f}x FLA (engine call) (< 1.3)")
        if n >= 256 and st == "fp32" and frac < 0.9:
            misses.append(f"{h}/{hv} {st} N={n}: {100 * frac:.1f}% of copy (< 90%)")
    lines += ["", "Targets missed: " + ("none" if not misses else "; ".join(misses))]
    return lines


def _split_tile(text: str) -> tuple[str | None, str]:
    """``"bf16:32x64s"`` -> ``("bf16", "32x64s")``; no prefix: ``(None, text)``."""
    state, sep, tile = text.rpartition(":")
    if sep and state not in STATE_DTYPES:
        raise ValueError(f"sweep tile {text!r}: the prefix must be one of {', '.join(STATE_DTYPES)}")
    return (state or None), tile


def _sweep_cases(tiles, states, log=print):
    """(DecodeTile, state name) pairs of a sweep: a ``STATE:`` prefix limits a tile to one state;
    tiles that cannot hold a state's dtype are skipped with a message."""
    from qla_serving.kernels import decode

    cases = []
    for text in tiles:
        only, tile_text = _split_tile(text)
        tile = decode.DecodeTile.parse(tile_text)
        for state_name in states:
            if only is not None and only != state_name:
                continue
            try:
                tile.check("float32" if state_name == "fp32" else "bfloat16")
            except ValueError as e:
                log(f"skip {tile} {state_name}: {e}")
                continue
            cases.append((tile, state_name))
    return cases


def compile_only(args, log=print) -> int:
    """Compile (or find in TileLang's cache) every decode kernel this command would run; no GPU.

    With ``TILELANG_CACHE_DIR`` set, the cache can then travel to the GPU machine.
    """
    from qla_serving.kernels import decode

    bf16, f32 = torch.bfloat16, torch.float32
    jobs = []  # (forced tile or None, H, HV, pool dtype)
    if args.sweep_tiles:
        for tile, state_name in _sweep_cases(args.sweep_tiles, args.sweep_state, log):
            jobs += [(tile, H, HV, STATE_DTYPES[state_name]) for H, HV in args.sweep_heads]
    if (not args.sweep_tiles or args.also_bench) and "qla" in args.impls:
        jobs += [(None, H, HV, STATE_DTYPES[st]) for H, HV in args.heads for st in args.state]
    t0, before = time.perf_counter(), decode.compiled_kernels()
    for tile, H, HV, pool_dtype in jobs:
        # The bench's inputs: bf16 activations and gate inputs, fp32 A_log/dt_bias, int32 indices.
        spec = {
            "dtype": bf16,
            "pool_dtype": pool_dtype,
            "gate_dtype": f32,
            "bias_dtype": f32,
            "ab_dtype": bf16,
        }
        if tile is None:
            decode.warmup(H, HV, 1, **spec)
        else:
            with decode.force_tile(tile):
                decode.warmup(H, HV, 1, **spec)
    log(
        f"{decode.compiled_kernels() - before} decode kernels compiled or loaded in {time.perf_counter() - t0:.0f} s"
    )
    return 0


def sweep_tiles(tiles, batches, heads, states, iters, copy_gbs, log=print, on_case=None):
    """Time our kernel under each candidate tile (forced for every batch), each checked against
    the oracle. Returns rows (``"impl": "qla"``, plus ``"tile"``) and the markdown lines;
    ``on_case(rows, lines)`` is called after each (tile, state) with the results so far."""
    from qla_serving.kernels import decode

    rows, notes, failed = [], [], set()
    for tile, state_name in _sweep_cases(tiles, states, log):
        t0, compiled0 = time.perf_counter(), decode.compiled_kernels()
        with decode.force_tile(tile):
            got, got_notes = run(batches, heads, [state_name], ["qla"], iters, log=lambda s: None)
        for note in got_notes:
            if "FAILS" in note or "failed" in note:
                failed.add((str(tile), state_name))
            notes.append(f"{note} [tile {tile}]")
        for r in got:
            r["tile"] = str(tile)
            log(
                f"tile {tile!s:10s} {r['hqk']}/{r['hv']} {state_name} N={int(r['batch']):4d} "
                f"{r['ms'] * 1e3:9.2f} us {r['gbs']:8.1f} GB/s"
            )
        rows += got
        log(
            f"tile {tile} {state_name}: {time.perf_counter() - t0:.1f} s, "
            f"{decode.compiled_kernels() - compiled0} kernels compiled or loaded"
        )
        if on_case is not None:
            on_case(rows, sweep_report(rows, failed, notes, copy_gbs))
    return rows, sweep_report(rows, failed, notes, copy_gbs)


SWEEP_BAND_SPLIT = 4096  # (sequence, head) pairs: 2/8 heads up to batch 512, 16/64 up to batch 64


def sweep_report(rows, failed, notes, copy_gbs) -> list[str]:
    """Markdown: every measurement, the best tile per cell next to the configured one, and the
    tile that is best overall below and above ``SWEEP_BAND_SPLIT`` pairs, per state."""
    from qla_serving.kernels import decode

    table = ["| tile | hqk/hv | state | batch | us | GB/s | % copy |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(
            f"| {r['tile']} | {r['hqk']}/{r['hv']} | {r['state']} | {r['batch']} | {r['ms'] * 1e3:.2f} | "
            f"{r['gbs']:.0f} | {100 * r['gbs'] / copy_gbs:.1f}% |"
        )
    best = [
        "",
        "Best tile per cell (tiles failing the oracle check left out):",
        "",
        "| hqk/hv | state | batch | configured tile | us | best tile | us | GB/s | % copy | gain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if (r["tile"], r["state"]) not in failed:
            cells.setdefault((r["hqk"], r["hv"], r["state"], int(r["batch"])), []).append(r)
    for (h, hv, st, n), rs in sorted(cells.items()):
        top = min(rs, key=lambda r: r["ms"])
        configured = str(decode._tile_for(n * hv, STATE_DTYPES[st]))
        cur = next((r for r in rs if r["tile"] == configured), None)
        best.append(
            f"| {h}/{hv} | {st} | {n} | {configured} | {cur['ms'] * 1e3:.2f} | "
            if cur
            else f"| {h}/{hv} | {st} | {n} | {configured} | – | "
        )
        best[-1] += (
            f"{top['tile']} | {top['ms'] * 1e3:.2f} | {top['gbs']:.0f} | {100 * top['gbs'] / copy_gbs:.1f}% | "
            + (f"{cur['ms'] / top['ms']:.3f}x |" if cur else "– |")
        )
    # One tile per band: the smallest geometric mean, over the band's cells, of time / the cell's best.
    overall = [
        "",
        f"Best tile per band (geometric mean of time / each cell's best; split at {SWEEP_BAND_SPLIT} pairs):",
        "",
    ]
    for st in STATE_DTYPES:
        for name, inside in (
            (f"<= {SWEEP_BAND_SPLIT} pairs", lambda p: p <= SWEEP_BAND_SPLIT),
            (f"> {SWEEP_BAND_SPLIT} pairs", lambda p: p > SWEEP_BAND_SPLIT),
        ):
            group = {key: rs for key, rs in cells.items() if key[2] == st and inside(key[1] * key[3])}
            if not group:
                continue
            tiles = set.intersection(*({r["tile"] for r in rs} for rs in group.values()))
            score = {}
            for t in tiles:
                logs = [
                    math.log(next(r["ms"] for r in rs if r["tile"] == t) / min(r["ms"] for r in rs))
                    for rs in group.values()
                ]
                score[t] = math.exp(sum(logs) / len(logs))
            ranked = sorted(score, key=score.get)
            overall.append(
                f"- {st}, {name} ({len(group)} cells): "
                + ", ".join(f"{t} {score[t]:.3f}x" for t in ranked[:5])
                + (f"; worst {ranked[-1]} {score[ranked[-1]]:.3f}x" if len(ranked) > 5 else "")
            )
    return table + best + overall + [""] + [ln for ln in notes if ln.startswith("- check")]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="qla-serving bench decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=common.positive_int, nargs="+", default=list(DEFAULT_BATCHES), help="batch sizes")
    ap.add_argument(
        "--heads",
        type=common.parse_heads,
        nargs="+",
        default=[common.parse_heads(h) for h in DEFAULT_HEADS],
        help="H/HV pairs, e.g. 16/64 2/8",
    )
    ap.add_argument("--state", choices=list(STATE_DTYPES), nargs="+", default=list(STATE_DTYPES))
    ap.add_argument("--impls", choices=IMPLS, nargs="+", default=list(DEFAULT_IMPLS))
    ap.add_argument("--iters", type=common.positive_int, default=100, help="timed graph replays per cell")
    ap.add_argument("--out-dir", default=None, help="results directory (default e2e_bench/results)")
    ap.add_argument(
        "--engine-fla",
        default=os.environ.get(ENGINE_FLA_ENV),
        metavar="DIR",
        help="directory holding vLLM's third_party/flash_linear_attention/ops/{fused_recurrent,"
        "fused_sigmoid_gating}.py, for the fla columns when vLLM is not installed "
        f"(default ${ENGINE_FLA_ENV})",
    )
    ap.add_argument(
        "--sweep-tiles",
        nargs="+",
        default=None,
        metavar="TILE",
        help="time our kernel with these tiles instead of the comparison: ROWSxTHREADS[lLANES][bMINBLOCKS][s], "
        "optionally prefixed fp32: or bf16: to time it with that state only",
    )
    ap.add_argument(
        "--sweep-heads",
        type=common.parse_heads,
        nargs="+",
        default=[common.parse_heads(h) for h in DEFAULT_SWEEP_HEADS],
    )
    ap.add_argument("--sweep-state", choices=list(STATE_DTYPES), nargs="+", default=list(STATE_DTYPES))
    ap.add_argument("--sweep-batch", type=common.positive_int, nargs="+", default=list(DEFAULT_SWEEP_BATCHES))
    ap.add_argument("--also-bench", action="store_true", help="after --sweep-tiles, run the comparison too")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="compile every decode kernel this command would run and stop (no GPU needed; set "
        "TILELANG_CACHE_DIR to fill a cache for the GPU machine)",
    )
    args = ap.parse_args(argv)
    if args.sweep_tiles:
        from qla_serving.kernels.decode import DecodeTile

        for text in args.sweep_tiles:  # bad tile text fails before any GPU work
            try:
                DecodeTile.parse(_split_tile(text)[1])
            except ValueError as e:
                ap.error(str(e))
    if args.compile_only:
        return compile_only(args)
    common.require_cuda(ap)
    meta = common.machine_meta()
    meta["command"] = " ".join(shlex.quote(x) for x in ["qla-serving", "bench", "decode", *argv])
    meta["iters"] = args.iters
    print(f"{meta['gpu']}: copy {meta['copy_gbs']} GB/s", flush=True)
    if args.sweep_tiles:
        path = common.results_path("decode-tiles", meta["gpu"], args.out_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = [
            f"# {path.stem}",
            "",
            f"- GPU: {meta['gpu']}",
            f"- command: `{meta['command']}`",
            f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
            (
                f"- copy {meta['copy_gbs']} GB/s; our kernel alone, tile forced for every batch; "
                "median us of CUDA-graph replays"
            ),
            "",
        ]

        def write(rows, lines):  # after every case: a run cut off keeps what it measured
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
            path.with_suffix(".md").write_text("\n".join(header + lines) + "\n")

        rows, lines = sweep_tiles(
            args.sweep_tiles,
            args.sweep_batch,
            args.sweep_heads,
            args.sweep_state,
            args.iters,
            meta["copy_gbs"],
            log=lambda s: print(s, flush=True),
            on_case=write,
        )
        write(rows, lines)
        print("\n".join(lines))
        print(f"wrote {path} and {path.with_suffix('.md')}", flush=True)
        if not args.also_bench:
            return 0
    impls, engine = [], None
    for name in args.impls:  # a competitor that cannot be loaded is left out, and said so
        try:
            if name == "qla":
                import tilelang  # noqa: F401
            elif name in ("fla", "fla-gating"):
                engine = engine or load_engine_fla(args.engine_fla)
            elif name == "fla-unindexed":
                import fla  # noqa: F401
            else:
                import flashinfer  # noqa: F401
            impls.append(name)
        except Exception as e:
            print(f"skipping {name}: {type(e).__name__}: {e}", file=sys.stderr)
    if engine is not None:
        meta["fla_engine"] = engine.label
    about = [
        (
            f"- fla: engines' call, {meta.get('fla_engine', 'not run')}: "
            "fused_recurrent_gated_delta_rule_packed_decode (vLLM 0.26 pure-decode path, SGLang "
            "packed_decode), pool + indices, in place, gate in kernel"
        ),
        (
            "- fla-gating: vLLM fused_sigmoid_gating_delta_rule_update (mixed-batch decode path), "
            "pool + indices, in place"
        ),
        (
            "- fla-unindexed: FLA 0.6.0 fused_recurrent_gated_delta_rule called directly, contiguous "
            "states, new fp32 state written (no pool indirection: not an engine's call)"
        ),
    ]
    path = common.results_path("decode", meta["gpu"], args.out_dir)
    rows, notes = [], []
    for heads in args.heads:  # results rewritten after each head configuration: a cut-off run keeps them
        got, got_notes = run(
            args.batch,
            [heads],
            args.state,
            impls,
            args.iters,
            log=lambda s: print(s, flush=True),
            engine=engine,
        )
        rows, notes = rows + got, notes + got_notes
        lines = summary(rows, meta["copy_gbs"])
        common.write_results(
            path,
            meta,
            rows,
            ["hqk", "hv", "state", "batch"],
            [i for i in IMPLS if i in impls],
            notes="\n".join(about + notes + lines),
        )
    print("\n".join(notes + lines))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
