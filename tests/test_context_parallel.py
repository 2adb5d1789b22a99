"""AutoCP reference and planner (CPU): segment-parallel prefill against the float64 oracle."""

import itertools
import math

import pytest
import torch
from helpers import cu_of, make_gates, make_qkv, rel_err

from qla_serving.constants import LOG_DECAY_THRESHOLD
from qla_serving.ops.gated_delta_rule.naive import (
    chunk_gated_delta_rule_cp_ref,
    recurrent_gated_delta_rule_ref,
)
from qla_serving.plan import ContextParallelPlan, plan_context_parallel


def _inputs(lengths, HV=4, K=16, gates="qwen"):
    T = sum(lengths)
    q, k, v = make_qkv(T, 1, HV, K, K)
    g, beta = make_gates(T, HV, "qwen")
    if gates == "adversarial":
        g[:, 0] = 0.0  # never decays: warm-up would be wrong
        block = (torch.arange(T) // 128) % 2 == 0
        g[:, 1] = torch.where(block, torch.tensor(-0.5, dtype=g.dtype), torch.tensor(0.0, dtype=g.dtype))
        g[:, 2] = -2.0  # always decays fast: warm-up is fine
    h0 = torch.randn(len(lengths), HV, K, K, dtype=torch.float64)
    return q, k, v, g, beta, h0


def _cp(lengths, seg=256, warm=128):
    return plan_context_parallel(lengths, 4, 132, segment_tokens=seg, warmup_tokens=warm, min_cp_tokens=512)


def _cp_and_oracle(lengths, gates, mode):
    """The AutoCP reference in ``mode`` (float64) and the token-by-token oracle on the same inputs:
    ``(o, state, used), (o_oracle, state_oracle)``."""
    q, k, v, g, beta, h0 = _inputs(lengths, gates=gates)
    cu = cu_of(lengths)
    o_r, s_r, _ = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True)
    cp = chunk_gated_delta_rule_cp_ref(q, k, v, g, beta, _cp(lengths), initial_state=h0, cu_seqlens=cu,
                                       use_qk_l2norm=True, mode=mode, dtype=torch.float64)
    return cp, (o_r, s_r)


@pytest.mark.parametrize("lengths", [[1000], [1000, 300, 5], [64 * 9, 777]])
@pytest.mark.parametrize("gates", ["qwen", "adversarial"])
def test_exact_mode_is_the_recurrence(lengths, gates):
    (o, s, used), (o_r, s_r) = _cp_and_oracle(lengths, gates, "exact")
    assert rel_err(o, o_r) <= 1e-10 and rel_err(s, s_r) <= 1e-10
    assert not any(u.any() for u in used)


@pytest.mark.parametrize("lengths", [[1000], [1000, 300, 5]])
@pytest.mark.parametrize("gates", ["qwen", "adversarial"])
def test_auto_mode_stays_under_the_decay_bound(lengths, gates):
    (o, s, used), (o_r, s_r) = _cp_and_oracle(lengths, gates, "auto")
    # The truncated history is scaled by at most exp(threshold) = 2^-16 (module docstring).
    bound = math.exp(LOG_DECAY_THRESHOLD)
    assert rel_err(o, o_r) <= 16 * bound and rel_err(s, s_r) <= 16 * bound
    if gates == "adversarial":
        assert not used[0][:, 0].any()  # the head that never decays is never warm-started
        assert used[0][1:, 2].all()  # the fast-decaying head always is


def test_forced_warmup_on_slow_heads_is_wrong():
    """The per-head decision matters: warm-starting a non-decaying head breaks the result."""
    (o, _, _), (o_r, _) = _cp_and_oracle([1000], "adversarial", "warmup")
    assert rel_err(o[:, 0], o_r[:, 0]) > 1e-3


def test_planner_splits_only_when_the_chain_length_bounds_the_time():
    # 8 value heads x 1 sequence = 8 blocks on 132 SMs: split into one wave of segments.
    cp = plan_context_parallel([32768], 8, 132)
    assert cp is not None and cp.segment_tokens % 64 == 0 and cp.segment_tokens >= 512
    assert len(cp.segments[0]) * 8 <= 132
    assert cp.segments[0] == tuple(range(0, 32768, cp.segment_tokens))
    # 64 value heads x 8 sequences = 512 blocks: the total work bounds the time, warm-up only adds.
    assert plan_context_parallel([4096] * 8, 64, 132) is None
    # Short sequences only: nothing to split.
    assert plan_context_parallel([2000, 1024], 8, 132) is None
    # Mixed long and short: only the long one is split.
    cp = plan_context_parallel([24576, 100], 8, 132)
    assert len(cp.segments[0]) > 1 and cp.segments[1] == (0,)


def test_planner_cost_model_prefers_one_wave():
    """One block per SM: 64 heads x 2 segments (128 blocks) fit one wave of 132 SMs, three
    segments would need two waves and lose."""
    cp = plan_context_parallel([32768], 64, 132)
    assert cp is not None and len(cp.segments[0]) == 2
    from qla_serving.plan import _makespan

    assert _makespan([512], 64, 132, 256, 4, 64) < _makespan([512], 64, 132, 171, 4, 64)
    assert _makespan([512], 64, 132, None, 4, 64) == 512


def test_planner_counts_whole_waves_of_equal_items():
    """Blocks of equal length run in whole waves: 64 heads x (3 + 1) items of ~128 chunks are two
    waves (264 chunk steps), x (9 + 3) items of ~43 are six (282); measured on an H200 the first
    is the faster (docs/autocp.md), and the planner picks it."""
    from qla_serving.plan import _makespan

    assert _makespan([384, 128], 64, 132, 128, 4, 32) == 2 * 132
    assert _makespan([384, 128], 64, 132, 43, 4, 32) == 6 * 47
    # very different lengths (one 64-chunk item among 500 one-chunk sequences): list scheduling
    # (the work over the SMs plus half the long item), not 243 waves of the longest
    assert _makespan([64], 64, 132, None, 4, 32, (1, 500, 500)) == (500 + 64) * 64 / 132 + 32
    assert plan_context_parallel([24576, 8192], 64, 132).segment_tokens == 8192


def test_planner_is_deterministic_and_validates_overrides():
    a = plan_context_parallel([24576, 8192], 16, 132)
    b = plan_context_parallel([24576, 8192], 16, 132)
    assert a == b
    with pytest.raises(ValueError, match="multiples of 64"):
        plan_context_parallel([8192], 8, 132, segment_tokens=1000)
    assert isinstance(plan_context_parallel([8192], 8, 132, segment_tokens=2048), ContextParallelPlan)


def test_documented_decision_table_is_the_planners():
    import pathlib

    from qla_serving.plan import decision_table

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "autocp.md").read_text()
    assert decision_table() in doc


def test_planner_balances_segments():
    cp = plan_context_parallel([24576, 8192], 8, 132)
    starts = cp.segments[0]
    lengths = [b - a for a, b in zip(starts, starts[1:] + (24576,))]
    assert max(lengths) - min(lengths) <= 64 and cp.segments[1] != (0,)


def test_each_sequence_alone_splits_as_the_planner_would_for_it_alone():
    """``plan_each_sequence_alone`` (``QLA_CP_PER_SEQUENCE=1``): on fresh random batches every
    sequence gets the segments the batch planner gives it alone, so they cannot follow the batch;
    the batch planner's own do (8 x 4096 at 32 heads fills the GPU unsplit, one 4096 alone splits)."""
    import random

    from qla_serving.plan import plan_each_sequence_alone

    rng = random.Random()
    for _ in range(20):
        lens = [rng.choice([1, rng.randint(2, 2047), rng.randint(2048, 40000)]) for _ in range(rng.randint(1, 12))]
        heads = rng.choice([8, 16, 32, 64])
        cp = plan_each_sequence_alone(lens, heads, 132)
        alone = [plan_context_parallel([L], heads, 132) for L in lens]
        want = tuple(a.segments[0] if a else (0,) for a in alone)
        if all(len(s) == 1 for s in want):
            assert cp is None, lens
            continue
        assert cp.segments == want, (lens, heads)
        assert cp.warmup_tokens == 256 and cp.segment_tokens == max(
            b - a for s, L in zip(want, lens) for a, b in zip(s, (*s[1:], L)))
    assert plan_context_parallel([4096] * 8, 32, 132) is None
    assert plan_each_sequence_alone([4096] * 8, 32, 132).segments == (plan_context_parallel([4096], 32, 132).segments[0],) * 8


def test_the_per_sequence_plan_is_read_from_the_environment(monkeypatch):
    """``plan_prefill`` plans per sequence under ``QLA_CP_PER_SEQUENCE=1``; its work items cover every
    chunk of every sequence once; ``QLA_BATCH_INVARIANT=1`` (no AutoCP) wins over it."""
    from qla_serving.plan import _work_items, plan_each_sequence_alone, plan_prefill

    for name in ("QLA_CP_SEGMENT_TOKENS", "QLA_BATCH_INVARIANT", "QLA_CP_PER_SEQUENCE"):
        monkeypatch.delenv(name, raising=False)
    lens = [4096] * 8 + [300]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    assert plan_prefill(cu, num_v_heads=32, sm_count=132).context_parallel is None
    monkeypatch.setenv("QLA_CP_PER_SEQUENCE", "1")
    cp = plan_prefill(cu, num_v_heads=32, sm_count=132).context_parallel
    assert cp == plan_each_sequence_alone(lens, 32, 132)
    chunks = [-(-n // 64) for n in lens]
    items = _work_items(chunks, cp, 64).tolist()
    for i, n in enumerate(chunks):  # (sequence, first chunk, first output chunk, end chunk)
        mine = sorted((out, end) for seq, _, out, end in items if seq == i)
        assert mine[0][0] == 0 and mine[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(mine))
    # the caller's choice (an engine's deterministic mode) over the environment, both ways
    assert plan_prefill(cu, num_v_heads=32, sm_count=132, cp_per_sequence=False).context_parallel is None
    monkeypatch.setenv("QLA_CP_PER_SEQUENCE", "0")
    assert plan_prefill(cu, num_v_heads=32, sm_count=132, cp_per_sequence=True).context_parallel == cp
    monkeypatch.setenv("QLA_BATCH_INVARIANT", "1")
    assert plan_prefill(cu, num_v_heads=32, sm_count=132).context_parallel is None
    assert plan_prefill(cu, num_v_heads=32, sm_count=132, cp_per_sequence=True).context_parallel is None


@pytest.mark.parametrize("per_sequence", [False, True])
def test_plans_of_random_batches_cover_every_chunk_once(per_sequence):
    """On fresh random batches (empty, one-token, short and long sequences; several head and SM
    counts; AutoCP by the batch or per sequence): the work items walk each sequence's chunks once,
    in order, in sequence order, each segment warming up from at most ``warmup`` chunks before it;
    the segments are where the plan says; and the plan's segment length is its longest segment,
    counted segment by segment."""
    import random

    from qla_serving.plan import plan_prefill

    rng = random.Random()
    planned = 0
    for _ in range(300):
        lens = [rng.choice([0, 1, rng.randint(2, 500), int(2 ** rng.uniform(9, 17))])
                for _ in range(rng.choice([1, 2, 5, 64]))]
        heads, sms = rng.choice([2, 8, 32, 64]), rng.choice([78, 132])
        plan = plan_prefill(cu_of(lens), num_v_heads=heads, sm_count=sms, cp_per_sequence=per_sequence)
        cp, items = plan.context_parallel, plan.work_items_cpu.tolist()
        chunks = [-(-n // 64) for n in lens]
        assert [r[0] for r in items] == sorted(r[0] for r in items)
        for i, n in enumerate(chunks):
            mine = [r for r in items if r[0] == i]
            outs = [r[2] for r in mine]
            assert outs[0] == 0 and [r[3] for r in mine] == outs[1:] + [n], (lens, i, mine)
            if cp is None:
                assert mine == [[i, 0, 0, n]]
                continue
            assert outs == [s // 64 for s in cp.segments[i]], (lens, i)
            assert all(r[1] == max(r[2] - cp.warmup_tokens // 64, 0) for r in mine)
        if cp is not None:
            planned += 1
            longest = max(b - a for s, L in zip(cp.segments, lens) for a, b in zip(s, s[1:] + (L,)))
            assert cp.segment_tokens == longest, (lens, cp.segment_tokens, longest)
    assert planned > 20  # AutoCP was planned often enough to be tested
