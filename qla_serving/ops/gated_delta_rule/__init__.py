"""The gated delta rule: fast paths (``chunk``, ``decode``) beside their references (``naive``)."""

from .chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_pool, chunk_gated_delta_rule_pool_packed
from .decode import gated_delta_rule_decode
from .naive import chunk_gated_delta_rule_ref, recurrent_decode_ref, recurrent_gated_delta_rule_ref

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_pool",
    "chunk_gated_delta_rule_pool_packed",
    "gated_delta_rule_decode",
    "chunk_gated_delta_rule_ref",
    "recurrent_decode_ref",
    "recurrent_gated_delta_rule_ref",
]
