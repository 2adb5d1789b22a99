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
from .constants import HEAD_DIM

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
        prefill_packed: whether prefill takes the engine's conv output and raw gate inputs (the
            packed-inputs kernels, with ``gate_dtype``/``bias_dtype``; the two prefill_ fields
            above do not apply).
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
    prefill_packed: bool = False


def kernel_warmup_specs(cfg: WarmupConfig) -> list[tuple[str, str, str, dict]]:
    """The kernel modules' warm-up calls for ``cfg``: ``(label, module, function, kwargs)``."""
    specs = []
    if "prefill" in cfg.phases:
        specs.append(("prefill", "qla_serving.kernels.chunk_prefill", "warmup", dict(
            num_qk_heads=cfg.num_qk_heads, num_v_heads=cfg.num_v_heads, dtype=cfg.dtype,
            beta_dtype=cfg.prefill_beta_dtype, pool_dtype=cfg.pool_dtype, use_qk_l2norm=cfg.prefill_qk_l2norm,
            packed_gate_dtypes=(cfg.gate_dtype, cfg.bias_dtype or cfg.gate_dtype) if cfg.prefill_packed else None)))
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
            log.warning("qla-serving: no start-up warm-up for %s: %s; its kernel loads (or compiles) on first use",
                        label, problem)
        else:
            steps.append((label, lambda fn=fn, kwargs=kwargs: fn(**kwargs)))
    return steps


def run_warmup(steps: list[tuple[str, Callable]], *, desc: str = "qla-serving: preparing GDN kernels",
               log: logging.Logger = logger, device: torch.device | str | None = None) -> int:
    """Run ``steps`` under a progress bar, without autograd; returns how many failed (each logged).
    With a CUDA ``device`` (steps that launch there: :func:`device_call_steps`), the device is
    synchronised after them, so their launches are done before the engine goes on.

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
            with torch.no_grad():
                fn()
        except Exception as e:
            if backend.strict_mode():
                raise backend.KernelUnavailable(f"qla-serving: start-up warm-up of {label} failed: {e}") from e
            failed += 1
            log.warning("qla-serving: start-up warm-up of %s failed (%s: %s); its kernel loads (or compiles) on first use",
                        label, type(e).__name__, e)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
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


# Lengths tried for the long prefill call, shortest first: the first one the planner splits into
# AutoCP segments on this device is run (the planner never splits below 2048 tokens).
LONG_PREFILL_TOKENS = (2048, 4096, 8192, 16384)


def long_prefill_tokens(num_v_heads: int, sm_count: int) -> int:
    """The shortest of :data:`LONG_PREFILL_TOKENS` that the planner runs as several AutoCP work
    items at ``num_v_heads`` heads on ``sm_count`` SMs (the longest where none is split)."""
    from .plan import plan_context_parallel

    for tokens in LONG_PREFILL_TOKENS:
        if sm_count and plan_context_parallel([tokens], num_v_heads, sm_count) is not None:
            return tokens
    return LONG_PREFILL_TOKENS[-1] if sm_count else LONG_PREFILL_TOKENS[0]


def device_call_steps(cfg: WarmupConfig, device: torch.device | str, *, A_log: torch.Tensor | None = None,
                      dt_bias: torch.Tensor | None = None) -> list[tuple[str, Callable]]:
    """Real op calls on ``device`` with ``cfg``'s dtypes: what loading a kernel does not do.

    A kernel taken from a library is only looked up by the kernel modules' ``warmup``; its first
    launch sets it up on the device (the library's per-kernel init, the driver loading its code).
    And a long single sequence takes a path no short prefill takes: the planner splits it into
    AutoCP segments (several work items per sequence, a snapshot of the start states, workspaces
    for its chunks). The prefill call is one such sequence, planned as the adapters plan a batch
    (with the value-head count, on this device's SMs), so the first long request of a served model
    runs nothing for the first time. Inputs are constants (no RNG) on a private one-slot pool.

    Args:
        cfg: the layer's static configuration (phases, heads, dtypes).
        device: the CUDA device the engine runs the layer on.
        A_log, dt_bias: the layer's gate parameters for the decode call (None: constants of
            ``cfg.gate_dtype`` / ``cfg.bias_dtype``).
    """
    from .ops.gated_delta_rule import (
        chunk_gated_delta_rule_pool,
        chunk_gated_delta_rule_pool_packed,
        gated_delta_rule_decode,
    )
    from .plan import _sm_count, plan_prefill

    dev = torch.device(device)
    H, HV, K = cfg.num_qk_heads, cfg.num_v_heads, HEAD_DIM
    steps = []

    def unit(*shape):
        return torch.full(shape, K**-0.5, dtype=cfg.dtype, device=dev)

    def pool():
        return torch.zeros(1, HV, K, K, dtype=cfg.pool_dtype, device=dev)

    def slot():
        return torch.zeros(1, dtype=torch.int32, device=dev)

    gate = A_log if A_log is not None else torch.full((HV,), -1.0, dtype=cfg.gate_dtype, device=dev)
    bias = dt_bias if dt_bias is not None else torch.zeros(HV, dtype=cfg.bias_dtype or cfg.gate_dtype, device=dev)

    if "prefill" in cfg.phases and cfg.prefill_packed:
        def packed_prefill_call():
            T = long_prefill_tokens(HV, _sm_count(dev))
            chunk_gated_delta_rule_pool_packed(
                unit(T, (2 * H + HV) * K), unit(T, HV), unit(T, HV), gate, bias, pool(), slot(), num_qk_heads=H,
                has_initial_state=torch.zeros(1, dtype=torch.bool, device=dev), scale=K**-0.5,
                plan=plan_prefill([0, T], device=dev, num_v_heads=HV))

        steps.append(("long prefill call", packed_prefill_call))
    elif "prefill" in cfg.phases:
        def prefill_call():
            T = long_prefill_tokens(HV, _sm_count(dev))
            chunk_gated_delta_rule_pool(
                unit(T, H, K), unit(T, H, K), unit(T, HV, K), torch.full((T, HV), -0.1, device=dev),
                torch.full((T, HV), 0.5, dtype=cfg.prefill_beta_dtype, device=dev), pool(), slot(),
                has_initial_state=torch.zeros(1, dtype=torch.bool, device=dev), scale=K**-0.5,
                use_qk_l2norm_in_kernel=cfg.prefill_qk_l2norm,
                plan=plan_prefill([0, T], device=dev, num_v_heads=HV))

        steps.append(("long prefill call", prefill_call))

    def decode_call(T: int):
        shape = (1, T) if T > 1 else (1,)
        gated_delta_rule_decode(
            unit(*shape, H, K), unit(*shape, H, K), unit(*shape, HV, K), unit(*shape, HV), unit(*shape, HV),
            gate, bias, pool(), slot(), scale=K**-0.5, use_qk_l2norm_in_kernel=True,
            intermediate_states=(torch.empty(1, T, HV, K, K, dtype=cfg.pool_dtype, device=dev) if T > 1 else None),
            inplace_final_state=T == 1)

    if "decode" in cfg.phases:
        steps.append(("decode call", lambda: decode_call(1)))
    if "verify" in cfg.phases and cfg.verify_tokens and cfg.verify_tokens > 1:
        steps.append(("speculative-verify call", lambda: decode_call(cfg.verify_tokens)))
    return steps


def warm_up(cfg: WarmupConfig, log: logging.Logger = logger) -> int:
    """Compile every kernel configuration ``cfg`` needs; returns how many steps ran cleanly."""
    steps = resolve_steps(kernel_warmup_specs(cfg), log)
    return len(steps) - run_warmup(steps, log=log)


__all__ = ["LONG_PREFILL_TOKENS", "WarmupConfig", "device_call_steps", "kernel_warmup_specs", "long_prefill_tokens",
           "resolve", "resolve_steps", "run_warmup", "warm_up"]
