"""qla-serving: Gated DeltaNet linear attention for vLLM and SGLang on Hopper GPUs.

A user of ``fla.ops.gated_delta_rule`` switches by changing the import::

    from qla_serving import chunk_gated_delta_rule
"""

from .ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_pool,
    chunk_gated_delta_rule_pool_packed,
    gated_delta_rule_decode,
)
from .plan import PrefillPlan, plan_prefill

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_pool",
    "chunk_gated_delta_rule_pool_packed",
    "gated_delta_rule_decode",
    "plan_prefill",
    "PrefillPlan",
]
