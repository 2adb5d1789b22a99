"""TileLang GDN kernels for SM90, installed as ``qla_serving.kernels``.

Importing this package does not import TileLang: the kernels are built on first use, once
per static configuration (see :mod:`qla_serving.kernels.configs`).
"""
