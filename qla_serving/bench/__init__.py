"""Benchmarks behind ``qla-serving bench``: side by side in one run on one GPU."""
