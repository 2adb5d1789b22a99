"""vLLM plugin: ``vllm serve <hybrid Qwen> --linear-attn-backend flashqla``.

Installed as ``qla_serving.integrations.vllm``; vLLM finds it through the
``vllm.general_plugins`` entry point ``qla_serving = qla_serving.integrations.vllm:register``
and calls :func:`register` in every process (API server, engine core, workers) before it
builds its argument parser or its model.

What :func:`register` does (each step idempotent, see docs/vllm.md):

1. checks the installed vLLM has every seam the plugin uses (:mod:`.compat`);
2. adds ``flashqla`` to ``--gdn-prefill-backend`` and the alias ``--linear-attn-backend``
   (:mod:`.args`; both set ``additional_config["gdn_prefill_backend"]``);
3. registers :class:`~.layer.QlaGatedDeltaNetAttention` for vLLM's
   ``QwenGatedDeltaNetAttention`` (PluggableLayer ``qwen_gated_delta_net_attention``) and
   :class:`~.layer.QlaChunkGatedDeltaRule` for the ``chunk_gated_delta_rule`` CustomOp. They
   behave exactly like vLLM's classes unless ``flashqla`` is requested;
4. registers the benchmark load format ``qla_dummy`` (:mod:`.bench_loader`).
"""

from __future__ import annotations

import logging

from .args import BACKEND_NAME

logger = logging.getLogger("vllm.qla_serving")

_registered = False


def register() -> None:
    """vLLM general-plugin entry point (vLLM may call it several times per process)."""
    global _registered
    if _registered:
        return
    from . import compat

    version = compat.check_vllm()
    if not compat.version_in_range(version):
        logger.warning(
            "qla-serving: vLLM %s is outside the supported range %s; its seams are present, continuing",
            version, compat.supported_range_text(),
        )

    from .args import install_cli_args

    install_cli_args()

    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        ChunkGatedDeltaRule,
        QwenGatedDeltaNetAttention,
    )

    from .layer import QlaChunkGatedDeltaRule, QlaGatedDeltaNetAttention

    # vLLM looks an out-of-tree replacement up by the replaced class's __name__.
    for base, ours in ((QwenGatedDeltaNetAttention, QlaGatedDeltaNetAttention),
                       (ChunkGatedDeltaRule, QlaChunkGatedDeltaRule)):
        current = op_registry_oot.get(base.__name__)
        if current is None:
            base.register_oot(ours)
            ours.name = base.name  # register_oot renames it; keep vLLM's op name in its records
        elif current is not ours:
            raise RuntimeError(
                f"qla-serving: another plugin already replaces vLLM's {base.__name__} with "
                f"{current.__module__}.{current.__qualname__}; two replacements cannot both run"
            )
    from .bench_loader import register_loader

    register_loader()
    _registered = True
    logger.debug("qla-serving: vLLM plugin registered (vLLM %s)", version)


__all__ = ["BACKEND_NAME", "register"]
