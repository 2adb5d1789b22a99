"""Forced answers for the stress harness: ``--logits-processors
qla_serving.integrations.vllm.forced:ForcedTokens`` on a benchmark server lets a request name the
tokens its answer must be (``vllm_xargs: {"qla_forced_tokens": [...]}``, a list of token ids).

Why: greedy answers compared with an oracle only share context up to their first divergence, and
on random weights the top next tokens sit a few bf16 steps apart, so every answer under load leaves
its oracle within a few tokens whatever the state (docs/e2e.md, "The positive control, run"). Forced
to the oracle's tokens, an answer under load has the oracle's context at every position, and its
logprobs (vLLM's raw logprobs, taken before any logits processor) can be compared position by
position: rounding moves them a few bf16 steps, a wrong state far more.

Requests without the key are left alone. vLLM refuses custom logits processors on speculative
servers, so only the stress server of a run takes it; this module imports vLLM and is loaded by
vLLM alone (no entry point: an installed ``vllm.logits_processors`` plugin would reach every
server of the environment).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

#: the ``vllm_xargs`` (``SamplingParams.extra_args``) key naming a request's forced tokens
FORCED_KEY = "qla_forced_tokens"
#: what a benchmark server's command adds to load it
LOGITS_PROCESSOR = "qla_serving.integrations.vllm.forced:ForcedTokens"


def forced_tokens(extra_args: dict | None) -> list[int] | None:
    """The token ids ``extra_args`` forces (None when it forces nothing).

    Raises:
        ValueError: the value is not a list of non-negative token ids.
    """
    value = (extra_args or {}).get(FORCED_KEY)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise ValueError(f"vllm_xargs[{FORCED_KEY!r}]: expected a list of token ids (ints >= 0), got {value!r}")
    return value


def force_next(forced: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """One request's logits row with every token but its next forced one at -inf; past the forced
    tokens the row is left as it is.

    Args:
        forced: the answer's tokens.
        output_ids: the tokens generated so far (vLLM's live list: its length is the position).
        logits: ``[vocab]`` float, the request's row.

    Raises:
        ValueError: the forced token is outside the vocabulary.
    """
    pos = len(output_ids)
    if pos >= len(forced):
        return logits
    token = forced[pos]
    if token >= logits.shape[-1]:
        raise ValueError(f"forced token {token} at position {pos} is outside the vocabulary ({logits.shape[-1]})")
    keep = logits[token].clone()
    logits.fill_(float("-inf"))
    logits[token] = keep
    return logits


class ForcedTokens(AdapterLogitsProcessor):
    """vLLM logits processor: each request with ``vllm_xargs[FORCED_KEY]`` samples those tokens."""

    @classmethod
    def validate_params(cls, params) -> None:
        forced_tokens(params.extra_args)

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the greedy choice: vLLM must run it for greedy requests too

    def new_req_logits_processor(self, params) -> Callable | None:
        forced = forced_tokens(params.extra_args)
        if forced is None:
            return None
        return lambda output_ids, logits: force_next(forced, output_ids, logits)
