"""Host work the ops do once per plan or once per process instead of once per layer call (issue #24;
``scripts/host_overhead.py`` measures it). Each test fails where the work is redone per call."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qla_serving
from qla_serving import backend, plan_prefill
from qla_serving.ops.gated_delta_rule import chunk as chunk_op

H, HV, K = 2, 4, 128


class _Syncs(TorchDispatchMode):
    """Counts reads of tensor values into Python (``int(t)``, ``t.item()``: a sync on a GPU tensor)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_plan_sizes_are_read_without_touching_its_tensors():
    """Every layer's op and kernel call reads the plan's sizes: host ints, not tensor reads."""
    plan = plan_prefill([0, 70, 70, 300], checkpoint_every=64)
    with _Syncs() as mode:
        for _ in range(3):  # three layers
            sizes = (
                plan.num_seqs,
                plan.total_tokens,
                plan.num_chunks,
                plan.num_checkpoints,
                plan.max_seqlen,
                plan.seq_lens,
            )
    assert mode.count == 0
    assert sizes == (3, 300, 2 + 0 + 4, 1 + 0 + 3, 230, [70, 0, 230])


def test_plan_tables_share_one_aligned_buffer_for_the_device_copy():
    """For a CUDA device the tables go in one pinned buffer and one copy (``_to_device``); each is a
    view at an offset as aligned as an allocation of its own, holding exactly its table."""
    from qla_serving import plan as plan_mod

    plan = plan_prefill([0, 5, 900, 901], num_v_heads=8, sm_count=132)
    tables = [
        plan.cu_seqlens,
        plan.chunk_offsets,
        plan.chunk_indices,
        plan.chunk_bounds,
        plan.checkpoint_offsets,
        plan.work_items,
    ]
    staging, offsets = plan_mod._pack(tables, pin=False)
    views = plan_mod._unpack(staging, tables, offsets)
    for view, table in zip(views, tables):
        assert view.shape == table.shape and view.dtype == torch.int32 and torch.equal(view, table)
        assert view.is_contiguous() and view.data_ptr() % 512 == staging.data_ptr() % 512
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    with pytest.raises(TypeError, match="int32"):
        plan_mod._pack([plan.cu_seqlens_cpu], pin=False)  # int64


@pytest.fixture
def kernels_here(monkeypatch):
    """The ops take their kernel path on this CPU (device decision: SM90), kernels recorded, not run."""
    monkeypatch.setattr(backend, "device_unsupported_reason", lambda device: None)
    monkeypatch.delenv("QLA_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("QLA_CHECK_INDICES", raising=False)


def test_prefill_without_has_initial_state_allocates_it_once_per_plan(kernels_here, monkeypatch):
    """SGLang passes no has_initial_state: every layer of the batch gets the same all-True tensor
    (made once per plan), not a fresh allocation and fill per layer."""
    seen = []
    monkeypatch.setattr(
        chunk_op, "_prefill_kernels", lambda: lambda *a, **kw: seen.append(kw["has_initial_state"])
    )
    T, lens = 75, [0, 70, 75]
    plan = plan_prefill(lens)
    q, k = torch.zeros(T, H, K, dtype=torch.bfloat16), torch.zeros(T, H, K, dtype=torch.bfloat16)
    v = torch.zeros(T, HV, K, dtype=torch.bfloat16)
    g, beta = torch.zeros(T, HV), torch.zeros(T, HV)
    pool = torch.zeros(4, HV, K, K)
    slots = torch.tensor([1, 3], dtype=torch.int32)
    for _ in range(3):  # three layers
        qla_serving.chunk_gated_delta_rule_pool(q, k, v, g, beta, pool, slots, plan=plan)
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2]
    assert seen[0].dtype == torch.bool and seen[0].tolist() == [True, True]
    # another plan (the next step) gets its own
    qla_serving.chunk_gated_delta_rule_pool(q, k, v, g, beta, pool, slots, plan=plan_prefill(lens))
    assert seen[3] is not seen[0]


def _decode_once(N=3, pool_dtype=torch.float32):
    q = torch.zeros(N, H, K, dtype=torch.bfloat16)
    v = torch.zeros(N, HV, K, dtype=torch.bfloat16)
    a = torch.zeros(N, HV, dtype=torch.bfloat16)
    qla_serving.gated_delta_rule_decode(
        q,
        q.clone(),
        v,
        a,
        a.clone(),
        torch.zeros(HV),
        torch.zeros(HV),
        torch.zeros(5, HV, K, K, dtype=pool_dtype),
        torch.tensor([0, 2, -1][:N], dtype=torch.int32),
    )


def test_decode_tile_table_is_parsed_once_not_per_call(kernels_here, monkeypatch):
    """The decode kernel entry picks its tile from DECODE_CONFIGS on every call; the table's parse
    (regex per band, tile checks) is memoised: no parse after the first call, a new parse when the
    table is replaced, and force_tile still wins."""
    from qla_serving.kernels import decode as kdecode
    from qla_serving.kernels import decode_tiles

    launched = []
    monkeypatch.setattr(kdecode, "_get_kernel", lambda key: lambda *args: launched.append(key))
    parses = []
    real_parse = decode_tiles.DecodeTile.parse.__func__
    monkeypatch.setattr(
        decode_tiles.DecodeTile,
        "parse",
        classmethod(lambda cls, text: parses.append(text) or real_parse(cls, text)),
    )
    _decode_once()  # the first call may parse (the table may already be memoised by earlier tests)
    parses.clear()
    for _ in range(5):  # five layers
        _decode_once()
    assert parses == [] and len(launched) == 6
    assert str(launched[-1].tile) == str(decode_tiles.tile_for(3 * HV, "float32"))
    # a replaced table is read again, and its tiles are the ones used
    monkeypatch.setattr(decode_tiles, "DECODE_CONFIGS", {"float32": {"bands": [(None, "32x128")]}})
    _decode_once()
    _decode_once()
    assert parses == ["32x128"] and str(launched[-1].tile) == "32x128"
    with kdecode.force_tile("64x64"):
        _decode_once()
    assert str(launched[-1].tile) == "64x64"
    # an invalid table still raises, on every call (nothing cached)
    monkeypatch.setattr(decode_tiles, "DECODE_CONFIGS", {"float32": {"bands": [(64, "8x32")]}})
    for _ in range(2):
        with pytest.raises(ValueError, match="last band"):
            _decode_once()
