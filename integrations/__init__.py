"""Engine adapters (vLLM, SGLang), installed as ``qla_serving.integrations``.

Each adapter only translates the engine's objects; planning, op calls, fallback policy and
compile warm-up live in ``qla_serving``.
"""
