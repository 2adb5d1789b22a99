"""Start-up compilation of the kernels a served model will call, with a progress bar.

Runs once per model runner, while SGLang builds its attention backends (before CUDA-graph
capture and before the first request), so no kernel is compiled while serving. Each kernel
module's ``warmup(...)`` compiles one static configuration or loads it from TileLang's disk
cache. A kernel module without ``warmup`` (or one that fails to import) is logged and
skipped: its first call compiles instead.

Nothing here is SGLang-specific except the choice of configurations; the vLLM adapter needs
the same loop (see the report: a candidate for ``qla_serving``).
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("qla_serving")


def warmup_specs(
    *,
    phases,
    num_qk_heads: int | None,
    num_v_heads: int,
    dtype: torch.dtype,
    pool_dtype: torch.dtype,
    gate_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int32,
    draft_tokens: int | None = None,
) -> list[tuple[str, str, str, dict]]:
    """The static configurations SGLang will call: ``(label, module, function, kwargs)``.

    Args:
        phases: subset of ``{"prefill", "decode", "verify"}`` routed to our kernels.
        num_qk_heads, num_v_heads: ``H`` and ``HV`` per rank (after tensor parallelism).
        dtype: activation dtype (q/k/v, decode's a/b). SGLang's prefill gate gives float32 beta.
        pool_dtype: the ``ssm_states`` pool dtype (``--mamba-ssm-dtype``).
        gate_dtype: dtype of the layers' ``A_log`` / ``dt_bias``.
        index_dtype: dtype of SGLang's ``cache_indices`` (int32).
        draft_tokens: speculative draft tokens per request (verify), or None.
    """
    if num_qk_heads is None:
        return []
    specs = []
    if "prefill" in phases:
        specs.append(
            (
                "prefill",
                "qla_serving.kernels.chunk_prefill",
                "warmup",
                dict(
                    num_qk_heads=num_qk_heads,
                    num_v_heads=num_v_heads,
                    dtype=dtype,
                    beta_dtype=torch.float32,
                    pool_dtype=pool_dtype,
                    use_qk_l2norm=True,
                ),
            )
        )
    common = dict(
        H=num_qk_heads,
        HV=num_v_heads,
        dtype=dtype,
        pool_dtype=pool_dtype,
        gate_dtype=gate_dtype,
        index_dtype=index_dtype,
        use_qk_l2norm=True,
    )
    if "decode" in phases:
        specs.append(("decode", "qla_serving.kernels.decode", "warmup", dict(common, T=1)))
    if "verify" in phases and draft_tokens and draft_tokens > 1:
        specs.append(
            (
                f"verify T={draft_tokens}",
                "qla_serving.kernels.decode",
                "warmup",
                dict(common, T=draft_tokens, intermediate_states=True, inplace_final_state=False),
            )
        )
    return specs


def _resolve(module: str, function: str) -> tuple[Callable | None, str | None]:
    try:
        fn = getattr(importlib.import_module(module), function, None)
    except Exception as e:  # a kernel module that cannot import must not stop the server here
        return None, f"{module} does not import ({e})"
    if fn is None:
        return None, f"{module} has no {function}()"
    return fn, None


def warmup_kernels(**config) -> int:
    """Compile every configuration of :func:`warmup_specs` with a progress bar; return how many ran.

    Accepts the keyword arguments of :func:`warmup_specs`. Failures are logged, not raised:
    the op compiles on first use instead (or, on a real error, fails there, loudly).
    """
    specs = warmup_specs(**config)
    if not specs:
        if config.get("num_qk_heads") is None:
            logger.warning(
                "qla-serving: no GDN layer found to read head counts from; kernels compile on first use"
            )
        return 0
    try:
        from tqdm import tqdm
    except ImportError:  # progress is nice to have
        tqdm = None
    bar = tqdm(total=len(specs), desc="qla-serving: compiling GDN kernels", unit="kernel") if tqdm else None
    done = 0
    start = time.perf_counter()
    for label, module, function, kwargs in specs:
        fn, problem = _resolve(module, function)
        if fn is None:
            logger.warning(
                "qla-serving: no start-up compile for %s: %s; it compiles on first use", label, problem
            )
        else:
            try:
                fn(**kwargs)
                done += 1
            except Exception as e:
                logger.warning(
                    "qla-serving: start-up compile of %s failed (%s: %s); it compiles on first use",
                    label,
                    type(e).__name__,
                    e,
                )
        if bar is not None:
            bar.set_postfix_str(label)
            bar.update(1)
    if bar is not None:
        bar.close()
    logger.info(
        "qla-serving: %d of %d GDN kernel configurations ready in %.1f s",
        done,
        len(specs),
        time.perf_counter() - start,
    )
    return done


__all__ = ["warmup_kernels", "warmup_specs"]
