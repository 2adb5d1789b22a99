"""The host-side planner."""

import random

import pytest
import torch

from qla_serving.plan import plan_prefill


def test_chunk_tables_cover_every_token():
    for _ in range(50):
        lengths = [random.choice([0, 1, 63, 64, 65, random.randint(1, 3000)]) for _ in range(random.randint(1, 12))]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        plan = plan_prefill(cu, checkpoint_every=128)
        assert plan.num_chunks == sum((L + 63) // 64 for L in lengths)
        assert plan.num_checkpoints == sum(L // 128 for L in lengths)
        assert plan.seq_lens == lengths and plan.total_tokens == sum(lengths)
        seen = []
        bounds = plan.chunk_bounds.tolist()
        for c, (seq, j) in enumerate(plan.chunk_indices.tolist()):
            start = int(cu[seq]) + 64 * j
            assert plan.chunk_offsets_cpu[seq] + j == c and start < cu[seq + 1]
            assert bounds[c] == [start, int(cu[seq + 1])]
            seen.extend(range(start, min(start + 64, int(cu[seq + 1]))))
        assert seen == list(range(sum(lengths)))


@pytest.mark.parametrize(
    "cu,kw,exc,match",
    [
        (torch.tensor([0, 5]).cuda() if torch.cuda.is_available() else torch.tensor([0, 5], device="meta"), {},
         ValueError, "needs cu_seqlens on the CPU"),
        (torch.tensor([0]), {}, ValueError, "at least 2 entries"),
        (torch.tensor([0.0, 5.0]), {}, TypeError, "integer tensor"),
        (torch.tensor([0, 5]), dict(checkpoint_every=32), ValueError, "positive multiple of 64"),
        (torch.tensor([0, 2**31]), {}, ValueError, "int32 index range"),
    ],
)
def test_plan_bad_input(cu, kw, exc, match):
    with pytest.raises(exc, match=match):
        plan_prefill(cu, **kw)


def test_work_items_without_and_with_context_parallelism():
    # without the head count: one item per sequence, (sequence, 0, 0, chunks), empty ones too
    plan = plan_prefill([0, 0, 70, 70 + 4096])
    assert plan.context_parallel is None
    assert plan.work_items_cpu.tolist() == [[0, 0, 0, 0], [1, 0, 0, 2], [2, 0, 0, 64]]
    # with it: the long sequence becomes segments, each after the first warming up 4 chunks
    plan = plan_prefill([0, 100, 100 + 32768], num_v_heads=8, sm_count=132)
    cp = plan.context_parallel
    assert cp is not None and cp.segments[0] == (0,)
    items = plan.work_items_cpu.tolist()
    assert items[0] == [0, 0, 0, 2]
    seg = cp.segment_tokens // 64
    long_items = items[1:]
    assert [r[2] for r in long_items] == list(range(0, 512, seg))
    assert all(r[1] == max(r[2] - 4, 0) for r in long_items)
    assert [r[3] for r in long_items] == [r[2] for r in long_items[1:]] + [512]
    # the start-state rows of a split batch are planned with the other tables, not made per call
    assert "seq_ids" in vars(plan) and plan.seq_ids.tolist() == [0, 1] and plan.seq_ids.dtype == torch.int32
    # the override: 0 turns it off, a length forces it
    assert plan_prefill([0, 32768], num_v_heads=8, sm_count=132, cp_segment_tokens=0).context_parallel is None
    forced = plan_prefill([0, 8192], num_v_heads=64, sm_count=132, cp_segment_tokens=2048)
    assert forced.work_items_cpu[:, 2].tolist() == [0, 32, 64, 96]
