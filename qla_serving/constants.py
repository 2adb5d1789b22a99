"""Constants shared by the kernels, the ops, their references and the planner (a leaf module:
it imports nothing, so every layer can import it and no import goes back up)."""

import math

BACKEND_NAME = "flashqla"  # the value of the engines' backend flags that selects these kernels
CHUNK_SIZE = 64  # tokens per chunk of the chunked prefill (kernels, references, planner)
HEAD_DIM = 128  # K = V: the only GDN head dim the kernels take
L2NORM_EPS = 1e-6  # q, k L2 norm: x / sqrt(sum(x^2) + eps)
SOFTPLUS_THRESHOLD = 20.0  # softplus(x) = x above it (the gate's dt)
MAX_DECODE_TOKENS = 16  # tokens per sequence in one decode call (1 + speculative drafts)
# AutoCP trusts a warm-up window whose decay is below 2^-16 (the error argument: ops/gated_delta_rule/naive.py, AutoCP reference).
LOG_DECAY_THRESHOLD = -16 * math.log(2)
