"""Start-up compilation of the kernels a served model needs, shared by the engine adapters.

An adapter describes a GDN layer's static configuration (:class:`WarmupConfig`: head counts
per rank, dtypes, which phases run on our kernels, speculative tokens). This module turns it
into the kernel modules' ``warmup(...)`` calls and runs them under a progress bar before the
engine reports ready, so nothing compiles while serving; TileLang's disk cache makes a warm
restart load instead of compile.

Policy, the same for every engine: a kernel module that does not import, or has no
``warmup``, is logged and skipped (its kernels compile on first use); a step that fails is
logged, or raised as :class:`~qla_serving.backend.KernelUnavailable` under ``QLA_STRICT=1``.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import backend

logger = logging.getLogger("qla_serving")

PHASES = frozenset({"prefill", "decode", "verify"})


@dataclass(frozen=True)
class WarmupConfig:
    """What one GDN layer's kernels are compiled for (runtime sizes are not part of it).

    Attributes:
        num_qk_heads, num_v_heads: ``H`` and ``HV`` on this rank (after tensor parallelism).
        dtype: activation dtype (q, k, v; decode's a and b).
        pool_dtype: the engine's recurrent-state pool dtype.
        gate_dtype: dtype of the layers' ``A_log``.
        bias_dtype: dtype of their ``dt_bias`` (None: ``gate_dtype``); the decode kernel is
            keyed on both, so a mismatch would compile while serving.
        index_dtype: dtype of the engine's state indices.
        phases: which of ``prefill``, ``decode``, ``verify`` run on our kernels.
        prefill_beta_dtype: dtype of beta as the engine hands it to prefill.
        prefill_qk_l2norm: whether prefill normalises q and k itself (False where the engine
            has already normalised them).
        verify_tokens: tokens per sequence in speculative verify (None or <= 1: no verify).
    """

    num_qk_heads: int
    num_v_heads: int
    dtype: torch.dtype
    pool_dtype: torch.dtype
    gate_dtype: torch.dtype = torch.float32
    bias_dtype: torch.dtype | None = None
    index_dtype: torch.dtype = torch.int32
    phases: frozenset = PHASES
    prefill_beta_dtype: torch.dtype = torch.float32
    prefill_qk_l2norm: bool = True
    verify_tokens: int | None = None


def kernel_warmup_specs(cfg: WarmupConfig) -> list[tuple[str, str, str, dict]]:
    """The kernel modules' warm-up calls for ``cfg``: ``(label, module, function, kwargs)``."""
    specs = []
    if "prefill" in cfg.phases:
        specs.append(("prefill", "qla_serving.kernels.chunk_prefill", "warmup", dict(
            num_qk_heads=cfg.num_qk_heads, num_v_heads=cfg.num_v_heads, dtype=cfg.dtype,
            beta_dtype=cfg.prefill_beta_dtype, pool_dtype=cfg.pool_dtype, use_qk_l2norm=cfg.prefill_qk_l2norm)))
    common = dict(H=cfg.num_qk_heads, HV=cfg.num_v_heads, dtype=cfg.dtype, pool_dtype=cfg.pool_dtype,
                  gate_dtype=cfg.gate_dtype, bias_dtype=cfg.bias_dtype or cfg.gate_dtype,
                  index_dtype=cfg.index_dtype, use_qk_l2norm=True)
    if "decode" in cfg.phases:
        specs.append(("decode", "qla_serving.kernels.decode", "warmup", dict(common, T=1)))
    if "verify" in cfg.phases and cfg.verify_tokens and cfg.verify_tokens > 1:
        specs.append((f"verify T={cfg.verify_tokens}", "qla_serving.kernels.decode", "warmup",
                      dict(common, T=cfg.verify_tokens, intermediate_states=True, inplace_final_state=False)))
    return specs


def resolve(module: str, function: str) -> tuple[Callable | None, str | None]:
    """``module.function``, or None and why not."""
    try:
        fn = getattr(importlib.import_module(module), function, None)
    except Exception as e:  # a kernel module that cannot import must not stop the engine here
        return None, f"{module} does not import ({type(e).__name__}: {e})"
    if fn is None:
        return None, f"{module} has no {function}()"
    return fn, None


def resolve_steps(specs: list[tuple[str, str, str, dict]], log: logging.Logger = logger) -> list[tuple[str, Callable]]:
    """Turn specs into ``(label, callable)`` steps; a spec that does not resolve is logged and left out."""
    steps = []
    for label, module, function, kwargs in specs:
        fn, problem = resolve(module, function)
        if fn is None:
            log.warning("qla-serving: no start-up compile for %s: %s; it compiles on first use", label, problem)
        else:
            steps.append((label, lambda fn=fn, kwargs=kwargs: fn(**kwargs)))
    return steps


def run_warmup(steps: list[tuple[str, Callable]], *, desc: str = "qla-serving: compiling GDN kernels",
               log: logging.Logger = logger) -> int:
    """Run ``steps`` under a progress bar; returns how many failed (each logged).

    Raises:
        KernelUnavailable: a step failed and ``QLA_STRICT=1``.
    """
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the progress bar is a convenience; the log lines below still report
        tqdm = None
    bar = tqdm(total=len(steps), desc=desc, unit="step") if tqdm else None
    failed = 0
    start = time.perf_counter()
    counts = kernel_counts()
    for label, fn in steps:
        if bar is not None:
            bar.set_postfix_str(label)
        try:
            fn()
        except Exception as e:
            if backend.strict_mode():
                raise backend.KernelUnavailable(f"qla-serving: start-up compile of {label} failed: {e}") from e
            failed += 1
            log.warning("qla-serving: start-up compile of %s failed (%s: %s); it compiles on first use",
                        label, type(e).__name__, e)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    after = kernel_counts()
    log.info("qla-serving: %d of %d warm-up steps done in %.1f s: %d kernels from precompiled libraries, "
             "%d compiled with TileLang", len(steps) - failed, len(steps), time.perf_counter() - start,
             after[0] - counts[0], after[1] - counts[1])
    return failed


def kernel_counts() -> tuple[int, int]:
    """(kernels taken from precompiled libraries, kernels compiled with TileLang) in this process."""
    try:
        from .kernels import chunk_prefill, decode, library
    except ImportError:  # a checkout without the kernels package mapped: nothing was loaded
        return 0, 0
    # a prefill configuration is two kernels
    return library.loaded, decode.compiled_kernels() + 2 * chunk_prefill.compile_count()


def warm_up(cfg: WarmupConfig, log: logging.Logger = logger) -> int:
    """Compile every kernel configuration ``cfg`` needs; returns how many steps ran cleanly."""
    steps = resolve_steps(kernel_warmup_specs(cfg), log)
    return len(steps) - run_warmup(steps, log=log)


__all__ = ["WarmupConfig", "kernel_warmup_specs", "resolve", "resolve_steps", "run_warmup", "warm_up"]
