"""Ops, FLA-style: one folder per op with its fast path and its reference side by side."""
