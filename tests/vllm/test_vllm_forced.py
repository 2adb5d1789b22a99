"""The stress harness's forced answers (``qla_serving.integrations.vllm.forced``) through vLLM's own
sampler and persistent-batch updates: forced requests sample their tokens, their logprobs are the
model's (raw, before the processor), other requests are untouched, moves and removals are followed."""

from __future__ import annotations

import pytest
import torch

VOCAB = 50


def _metadata(procs, outputs: list[list[int]], batch: int):
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=2, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=outputs, allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=procs)


def _params(tokens=None):
    from vllm import SamplingParams

    from qla_serving.integrations.vllm import forced

    return SamplingParams(temperature=0, max_tokens=8,
                          extra_args=None if tokens is None else {forced.FORCED_KEY: tokens})


def test_forced_requests_sample_their_tokens_with_the_models_logprobs():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors, MoveDirectionality
    from vllm.v1.sample.sampler import Sampler

    from qla_serving.integrations.vllm import forced

    gen = torch.Generator().manual_seed(0)
    proc = forced.ForcedTokens(None, torch.device("cpu"), False)
    procs = LogitsProcessors([proc])
    assert proc in procs.non_argmax_invariant  # vLLM runs it for greedy requests
    want_a = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    want_c = torch.randint(0, VOCAB, (3,), generator=gen).tolist()  # shorter than the answer: then free
    outputs = [[], [], []]
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, _params(want_a), None, outputs[0]), (1, _params(), None, outputs[1]), (2, _params(want_c), None, outputs[2])]))
    sampler = Sampler()
    for step in range(6):
        if step == 3:
            # vLLM condenses the batch: request 2 moves to row 1, request 1's row is freed
            proc.update_state(BatchUpdate(batch_size=2, removed=[1], added=[],
                                          moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
            outputs = [outputs[0], outputs[2]]
        logits = torch.randn(len(outputs), VOCAB, generator=gen)
        out = sampler(logits.clone(), _metadata(procs, outputs, len(outputs)))
        sampled = out.sampled_token_ids[:, 0].tolist()
        raw = torch.log_softmax(logits, dim=-1)
        lp = out.logprobs_tensors.logprobs[:, 0]  # the sampled token's logprob comes first
        for row, tok in enumerate(sampled):
            torch.testing.assert_close(lp[row], raw[row, tok])  # the model's, not the processor's
        if step < 3:
            assert sampled[0] == want_a[step] and sampled[2] == want_c[step]
            assert sampled[1] == int(logits[1].argmax())  # untouched
        else:
            assert sampled[0] == want_a[step]
            assert sampled[1] == int(logits[1].argmax())  # request 2 past its forced tokens: free
        for o, tok in zip(outputs, sampled):
            o.append(tok)
    assert outputs[0] == want_a and outputs[1][:3] == want_c


def test_bad_forced_tokens_are_refused():
    from qla_serving.integrations.vllm import forced

    for bad in ("1,2", [1, -2], [1.0], [True]):
        with pytest.raises(ValueError, match=forced.FORCED_KEY):
            forced.ForcedTokens.validate_params(_params(bad))
    forced.ForcedTokens.validate_params(_params())  # nothing forced: nothing to check
    with pytest.raises(ValueError, match="outside the vocabulary"):
        forced.force_next([VOCAB], [], torch.zeros(VOCAB))
