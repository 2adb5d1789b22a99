"""``qla-serving compile``: build the kernels of given GDN configurations into a precompiled
kernel library (:mod:`qla_serving.kernels.library`) that the package loads without TileLang.

The wheel ships the library of :data:`~qla_serving.kernels.configs.SHIPPED_CONFIGS`
(``--shipped``); a model outside it gets its own library (by default in the user's cache
directory, which the package searches), so that an engine compiles nothing at start-up.
Configurations come from head counts or from a model's ``config.json`` and the tensor-parallel
sizes to serve it at; each engine hands the kernels its inputs in its own way, hence ``--engine``.
Building needs TileLang 0.1.15 and nvcc, not a GPU.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

import torch

from .warmup import WarmupConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What each engine's adapter hands the prefill kernels (integrations/*/warmup.py): first its classic
# call's mode, then further prefill-only modes, each applied over the first. vLLM normalises q and k
# in its own fused kernel first, or (QLA_PREFILL_PACKED, the default) hands over its conv output and
# raw gates; SGLang leaves the normalisation to ours.
ENGINE_PREFILL = {"vllm": ({"prefill_qk_l2norm": False}, {"prefill_packed": True}),
                  "sglang": ({"prefill_qk_l2norm": True},)}


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
    """One :class:`WarmupConfig` per (heads, activation dtype, state dtype, verify length), and a
    prefill-only one per further prefill mode of the engine (``ENGINE_PREFILL``).

    ``bias_dtype`` None: the activation dtype, as both engines create ``dt_bias`` (and ``A_log``
    in float32, the default ``gate_dtype``).
    """
    if engine not in ENGINE_PREFILL:
        raise ValueError(f"engine {engine!r}: expected one of {sorted(ENGINE_PREFILL)}")
    out = []
    for h, hv in dict.fromkeys(heads):
        for dt in dtypes:
            for st in states:
                base = WarmupConfig(num_qk_heads=h, num_v_heads=hv, dtype=DTYPES[dt], pool_dtype=DTYPES[st],
                                    gate_dtype=DTYPES[gate_dtype],
                                    bias_dtype=DTYPES[bias_dtype or dt],
                                    prefill_beta_dtype=torch.float32, **ENGINE_PREFILL[engine][0])
                out.append(base)
                out += [replace(base, phases=frozenset({"prefill"}), **mode) for mode in ENGINE_PREFILL[engine][1:]]
                out += [replace(base, phases=frozenset({"verify"}), verify_tokens=t) for t in verify_tokens if t > 1]
    return out


def shipped_configs() -> list[WarmupConfig]:
    """The configurations of the library the wheel ships (``SHIPPED_CONFIGS``)."""
    from .kernels.configs import SHIPPED_CONFIGS as S

    heads = [per_rank((S["qk_heads"], hv), tp) for hv in S["v_heads"] for tp in S["tp"]]
    out = []
    for i, engine in enumerate(S["engines"]):
        configs = plan_configs(heads, engine=engine, dtypes=list(S["dtypes"]), states=list(S["states"]),
                               verify_tokens=list(S["verify_tokens"]))
        # the engines call decode and verify alike: those kernels are built once, for the first
        out += configs if i == 0 else [replace(c, phases=frozenset({"prefill"})) for c in configs
                                       if "prefill" in c.phases]
    return list(dict.fromkeys(out))


def default_library_dir(shipped: bool = False) -> pathlib.Path:
    """Where ``qla-serving compile`` writes: the user's cache directory, or with ``shipped`` the
    package's own (``kernels/shipped``, what a wheel built afterwards carries)."""
    from .kernels import library

    return library.SHIPPED_DIR if shipped else library.USER_DIR


def build(configs: list[WarmupConfig], out_dir, jobs: int | None = None) -> dict:
    """Build ``configs`` into a library at ``out_dir`` (:func:`qla_serving.library_build.build_library`)."""
    from .library_build import build_library

    return build_library(configs, out_dir, jobs=jobs)


__all__ = ["DTYPES", "build", "default_library_dir", "model_heads", "per_rank", "plan_configs", "shipped_configs"]
