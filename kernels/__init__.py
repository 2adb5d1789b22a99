"""TileLang GDN kernels for SM90, installed as ``qla_serving.kernels``.

Importing this package does not import TileLang: each kernel is loaded from a precompiled
library (:mod:`qla_serving.kernels.library`) or, for a configuration no library holds, compiled
with TileLang on first use, once per static configuration (see :mod:`qla_serving.kernels.configs`).
"""
