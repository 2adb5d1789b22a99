"""What ``extend`` hands the op in every GDN layer of a batch (issue #24): the batch's plan and
SGLang's own tensors, with no per-layer copy, slice or allocation where none is needed."""

import torch
from test_sglang_kernel import extend_batch, extend_inputs, make_kernel, make_pool


def test_extend_passes_the_batch_plan_and_sglangs_tensors_through(monkeypatch):
    import qla_serving.integrations.sglang.kernel as kmod

    from qla_serving.ops.gated_delta_rule import chunk as chunk_op

    calls, initial = [], []
    real_op, real_run = kmod.chunk_gated_delta_rule_pool, chunk_op._run_prefill
    monkeypatch.setattr(
        kmod, "chunk_gated_delta_rule_pool", lambda *a, **kw: calls.append((a, kw)) or real_op(*a, **kw)
    )
    monkeypatch.setattr(
        chunk_op,
        "_run_prefill",
        lambda *a, **kw: initial.append(kw["has_initial_state"]) or real_run(*a, **kw),
    )
    lens = [65, 3, 1]
    kernel = make_kernel()
    fb, md, backend = extend_batch(lens, [1, 2, 5])
    kernel.begin_batch(backend, fb)
    q, k, v, g, beta = extend_inputs(lens)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # as SGLang's fused split gives them on a GPU
    for pool in [make_pool(torch.float32) for _ in range(3)]:  # three GDN layers
        kernel.extend(
            q,
            k,
            v,
            g,
            beta,
            ssm_states=pool,
            cache_indices=md.mamba_cache_indices,
            query_start_loc=md.query_start_loc,
        )
    assert len(calls) == 3
    plans = {id(kw["plan"]) for _, kw in calls}
    assert len(plans) == 1 and calls[0][1]["plan"] is kernel._batches[0].plan
    for args, kw in calls:
        assert kw["state_indices"] is md.mamba_cache_indices  # all rows are the batch's: no slice
        for given, passed in zip((q, k, v, g, beta), args):
            assert passed.data_ptr() == given.data_ptr()  # views, not copies
    # no has_initial_state from SGLang: one all-True tensor for the batch, not one per layer
    assert len(initial) == 3 and initial[0] is initial[1] is initial[2] and initial[0].all()
