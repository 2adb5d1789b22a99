"""``--load-format qla_dummy``: vLLM's dummy weights with GDN gates that remember (benchmarks).

vLLM's dummy loader gives every GDN head a decay of ~0.5 per token, so a state carried wrongly
across chunks, steps or the prefix cache would not change a single output token. This loader
runs vLLM's dummy loader, then re-draws ``A_log`` and ``dt_bias`` of every GDN layer with
:func:`qla_serving.bench.gates.init_gdn_gates` (decays from a few to about a thousand tokens),
seeded by the module name, so every backend's server holds the same weights. With
``QLA_BENCH_WEIGHTS=random`` it first re-draws every other weight as well
(:func:`qla_serving.bench.weights.init_random_weights`: dummy weights' greedy tokens are one token
repeated); with ``QLA_BENCH_FAULT`` it installs that state fault (:mod:`qla_serving.bench.faults`,
the stress harness's positive control). The serving
benchmark (``e2e_bench/serve.py``) starts ``vllm serve`` with it; registered by the plugin.
"""

from __future__ import annotations

import logging

LOAD_FORMAT = "qla_dummy"

logger = logging.getLogger("vllm.qla_serving")


def register_loader() -> None:
    """Register :data:`LOAD_FORMAT` with vLLM's model-loader registry (idempotent)."""
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader import dummy_loader

    from qla_serving.bench.faults import install_vllm_fault, requested_fault
    from qla_serving.bench.gates import init_gdn_gates
    from qla_serving.bench.weights import init_requested_weights

    if LOAD_FORMAT in model_loader._LOAD_FORMAT_TO_MODEL_LOADER:  # vLLM warns on a re-registration
        return

    class GdnGatesDummyLoader(dummy_loader.DummyModelLoader):
        """vLLM's dummy weights, then GDN gates re-drawn (see the module docstring)."""

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            if drawn := init_requested_weights(model):
                logger.info("qla-serving: %s with %s", LOAD_FORMAT, drawn)
            layers = init_gdn_gates(model)
            logger.info("qla-serving: %s: re-drew the gates of %d GDN layers", LOAD_FORMAT, layers)
            if fault := requested_fault():
                logger.warning("qla-serving: benchmark fault injected (%s): %s", "QLA_BENCH_FAULT",
                               install_vllm_fault(fault))

    model_loader.register_model_loader(LOAD_FORMAT)(GdnGatesDummyLoader)
