"""vLLM plugin: ``vllm serve <hybrid Qwen> --linear-attn-backend flashqla``.

Installed as ``qla_serving.integrations.vllm``; vLLM finds it through the
``vllm.general_plugins`` entry point ``qla_serving = qla_serving.integrations.vllm:register``
and calls :func:`register` in every process (API server, engine core, workers) before it
builds its argument parser or its model.

What :func:`register` does (each step idempotent, see docs/vllm.md):

1. checks the installed vLLM's version and the argument seams (:mod:`.compat`);
2. adds ``flashqla`` to ``--gdn-prefill-backend`` and the alias ``--linear-attn-backend``
   (:mod:`.args`; both set ``additional_config["gdn_prefill_backend"]``);
3. where the process imports vLLM's GDN layer module (the engine core and workers, which build
   the model; the API server never does, and pays nothing for it), checks the layer and
   backend seams and registers :class:`~.layer.QlaGatedDeltaNetAttention` for vLLM's
   ``QwenGatedDeltaNetAttention`` (PluggableLayer ``qwen_gated_delta_net_attention``) and
   :class:`~.layer.QlaChunkGatedDeltaRule` for the ``chunk_gated_delta_rule`` CustomOp. They
   behave exactly like vLLM's classes unless ``flashqla`` is requested;
4. where it imports vLLM's model-loader registry, registers the benchmark load format
   ``qla_dummy`` (:mod:`.bench_loader`).
"""

from __future__ import annotations

import logging
import sys

from .args import BACKEND_NAME

logger = logging.getLogger("vllm.qla_serving")

_registered = False


def register() -> None:
    """vLLM general-plugin entry point (vLLM may call it several times per process)."""
    global _registered
    if _registered:
        return
    from . import compat

    version = compat.check_vllm((compat.ARG_MODULE,))
    if not compat.version_in_range(version):
        logger.warning(
            "qla-serving: vLLM %s is outside the supported range %s; its seams are present, continuing",
            version, compat.supported_range_text(),
        )

    from .args import install_cli_args

    install_cli_args()
    compat.after_import(compat.GDN_LAYER_MODULE, _register_layers)
    compat.after_import(compat.MODEL_LOADER_MODULE, _register_loader)
    _registered = True
    logger.debug("qla-serving: vLLM plugin registered (vLLM %s)", version)


layers_wanted = False  # register() saw vLLM's GDN layer module imported in this process


def _register_layers(_module=None) -> None:
    global layers_wanted
    layers_wanted = True
    ours = sys.modules.get(f"{__name__}.layer")
    if ours is not None and not hasattr(ours, "register_layers"):
        return  # our layer module is importing vLLM's right now: it registers when it is done
    from .layer import register_layers

    register_layers()


def _register_loader(_module=None) -> None:
    from .bench_loader import register_loader

    register_loader()


__all__ = ["BACKEND_NAME", "register"]
