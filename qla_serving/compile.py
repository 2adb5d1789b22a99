"""``qla-serving compile``: build the kernels of given GDN configurations ahead of serving.

An engine compiles (or loads from TileLang's disk cache) the kernels of its model's configuration
at start-up (:mod:`qla_serving.warmup`). Running this first, with the same ``TILELANG_CACHE_DIR``
the server will use (an image build, say), leaves nothing to compile at start-up. Configurations
come from head counts or from a model's ``config.json`` and the tensor-parallel sizes to serve it
at; each engine hands the kernels its inputs in its own way, hence ``--engine``.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

import torch

from .warmup import WarmupConfig, kernel_warmup_specs, resolve_steps, run_warmup

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What each engine's adapter hands the prefill kernels (integrations/*/warmup.py): vLLM normalises
# q and k in its own fused kernel first, SGLang leaves it to ours.
ENGINE_PREFILL = {"vllm": {"prefill_qk_l2norm": False}, "sglang": {"prefill_qk_l2norm": True}}


def model_heads(config_path: str | pathlib.Path) -> tuple[int, int]:
    """``(H, HV)``, the GDN q/k and value heads of a hybrid Qwen ``config.json`` (text config
    nested or not)."""
    cfg = json.loads(pathlib.Path(config_path).read_text())
    text = cfg.get("text_config", cfg)
    try:
        return int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    except KeyError:
        raise ValueError(f"{config_path}: no linear_num_key_heads / linear_num_value_heads: "
                         "not a hybrid Qwen (GDN) model config") from None


def per_rank(heads: tuple[int, int], tp: int) -> tuple[int, int]:
    h, hv = heads
    if h % tp or hv % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the GDN heads {h}/{hv}")
    return h // tp, hv // tp


def plan_configs(heads: list[tuple[int, int]], *, engine: str, dtypes: list[str], states: list[str],
                 verify_tokens: list[int] = (), gate_dtype: str = "fp32", bias_dtype: str | None = None
                 ) -> list[WarmupConfig]:
    """One :class:`WarmupConfig` per (heads, activation dtype, state dtype, verify length)."""
    if engine not in ENGINE_PREFILL:
        raise ValueError(f"engine {engine!r}: expected one of {sorted(ENGINE_PREFILL)}")
    out = []
    for h, hv in dict.fromkeys(heads):
        for dt in dtypes:
            for st in states:
                base = WarmupConfig(num_qk_heads=h, num_v_heads=hv, dtype=DTYPES[dt], pool_dtype=DTYPES[st],
                                    gate_dtype=DTYPES[gate_dtype],
                                    bias_dtype=DTYPES[bias_dtype] if bias_dtype else None,
                                    prefill_beta_dtype=torch.float32, **ENGINE_PREFILL[engine])
                out.append(base)
                out += [replace(base, phases=frozenset({"verify"}), verify_tokens=t) for t in verify_tokens if t > 1]
    return out


def compile_configs(configs: list[WarmupConfig]) -> int:
    """Compile every kernel the configurations need, under one progress bar; returns failures."""
    steps = []
    for cfg in configs:
        label = f"{cfg.num_qk_heads}/{cfg.num_v_heads} {str(cfg.dtype)[6:]} state {str(cfg.pool_dtype)[6:]}"
        steps += [(f"{label} {name}", fn) for name, fn in resolve_steps(kernel_warmup_specs(cfg))]
    return run_warmup(steps, desc="qla-serving compile")


__all__ = ["DTYPES", "compile_configs", "model_heads", "per_rank", "plan_configs"]
