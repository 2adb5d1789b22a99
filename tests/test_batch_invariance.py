"""``QLA_BATCH_INVARIANT=1``: a sequence's outputs and state are the same bits whatever else its call
holds (docs/e2e.md, "Batch invariance").

On the CPU: the decode tile every pair count gets (one lane count per pool dtype, a tile the
shipped library holds) and the prefill plan (no AutoCP). On the GPU (``gpu`` marker): one
sequence run alone and at a place in a larger call of the same kernels, fresh random inputs, its
rows and its pool slot compared bit for bit, and against the float64 recurrence.
"""

import os
import subprocess
import sys

import pytest
import torch
from helpers import rel_err

from qla_serving.ops.gated_delta_rule.naive import recurrent_decode_ref
from qla_serving.plan import plan_prefill

K = V = 128
PAIRS = (1, 32, 128, 129, 4096, 10**6)


def test_decode_tiles_share_one_lane_count(monkeypatch):
    """Flag or not, every pair count of a pool dtype gets one of the configured tiles, all of one
    lane count (the library holds every one); the flag does not touch the decode's choice."""
    from qla_serving.kernels import decode

    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        configured = {t for _, t in decode._configured_tiles(name)}
        tiles = [decode._tile_for(p, dtype) for p in PAIRS]
        assert len({t.lanes_per_row for t in tiles}) == 1 and set(tiles) <= configured, (name, tiles)
        assert tiles == [decode.tile_for(p, name) for p in PAIRS]
        monkeypatch.setenv("QLA_BATCH_INVARIANT", "1")
        assert [decode._tile_for(p, dtype) for p in PAIRS] == tiles
        monkeypatch.delenv("QLA_BATCH_INVARIANT")


def test_each_pool_dtypes_bands_share_one_lane_count():
    """Without the flag too: the configured decode bands of a pool dtype have one lane count, so a
    sequence's decode has one summation order at every batch size (kernels/configs.py)."""
    from qla_serving.kernels import decode

    for name in ("float32", "bfloat16"):
        bands = decode._configured_tiles(name)
        assert len(bands) > 1, "one band: the test would prove nothing"
        lanes = {t.lanes_per_row for _, t in bands}
        assert len(lanes) == 1, (name, [str(t) for _, t in bands])


def test_the_flag_is_read_by_a_fresh_process():
    code = ("import torch; from qla_serving.kernels import decode; "
            "print(decode._tile_for(10**5, torch.float32).lanes_per_row, decode._tile_for(1, torch.float32).lanes_per_row)")
    env = {**os.environ, "QLA_BATCH_INVARIANT": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    large, small = r.stdout.split()
    assert large == small, r.stdout
    env["QLA_BATCH_INVARIANT"] = "0"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    from qla_serving.kernels import decode

    assert r.stdout.split() == [str(decode.tile_for(10**5, "float32").lanes_per_row),
                                str(decode.tile_for(1, "float32").lanes_per_row)]


def test_no_autocp_under_the_flag(monkeypatch):
    """AutoCP splits a long sequence alone and not beside others: under the flag it plans none
    (an explicit segment length, an experiment's, still splits)."""
    monkeypatch.delenv("QLA_CP_SEGMENT_TOKENS", raising=False)
    monkeypatch.delenv("QLA_BATCH_INVARIANT", raising=False)
    alone = [0, 4096]
    assert plan_prefill(alone, num_v_heads=32, sm_count=132).context_parallel is not None
    monkeypatch.setenv("QLA_BATCH_INVARIANT", "1")
    assert plan_prefill(alone, num_v_heads=32, sm_count=132).context_parallel is None
    assert plan_prefill(alone, num_v_heads=32, sm_count=132, cp_segment_tokens=1024).context_parallel is not None


@pytest.mark.gpu
@pytest.mark.parametrize("flag", [False, True], ids=["default", "flag"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_decode_alone_and_in_a_large_batch_are_the_same_bits(pool_dtype, flag):
    """One sequence at 16/32 heads: alone (32 pairs, the small band) and at a random place among
    63 others (2048 pairs, the large band), the same output and state bits with the configured
    bands and under the flag, and both within tolerance of the float64 recurrence."""
    from qla_serving.bench.invariance import batch_invariant, decode_alone_and_in_batch

    with batch_invariant(flag):
        d = decode_alone_and_in_batch(pool_dtype)
    name = str(pool_dtype).split(".")[1]
    from qla_serving.kernels import decode

    assert decode.tile_for(32, name) != decode.tile_for(64 * 32, name)  # two bands: a real test
    assert torch.equal(d["out"][0], d["out"][1]), "the output depends on the batch"
    assert torch.equal(d["state"][0], d["state"][1]), "the state depends on the batch"
    q, k, v, a, b, A_log, dt_bias, init = d["inputs"]
    o_ref, s_ref = recurrent_decode_ref(q, k, v, a, b, A_log, dt_bias, init, scale=K**-0.5, use_qk_l2norm=True)
    assert rel_err(d["out"][0], o_ref[0]) < 1e-2
    assert rel_err(d["state"][0], s_ref[0, -1]) < (1e-4 if pool_dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_alone_and_beside_others_are_the_same_bits(pool_dtype, monkeypatch):
    """A 4096-token sequence at 16/32 heads, which AutoCP splits when it runs alone: alone and
    between two other sequences, the same output and final state bits under the flag."""
    from qla_serving.bench.invariance import batch_invariant, prefill_alone_and_beside

    monkeypatch.delenv("QLA_CP_SEGMENT_TOKENS", raising=False)
    with batch_invariant(False):
        assert prefill_alone_and_beside(pool_dtype, length=2048, before=64, after=64)["split"][0]
    with batch_invariant(True):
        p = prefill_alone_and_beside(pool_dtype)
    assert p["split"] == [False, False]
    assert torch.equal(p["out"][0], p["out"][1]), "the output depends on the batch"
    assert torch.equal(p["state"][0], p["state"][1]), "the final state depends on the batch"
    assert torch.isfinite(p["out"].float()).all()


def _check_whole_and_cut(c: dict, out_tol: float, state_tol: float) -> None:
    r, ref = c["qla"], c["ref"]
    for i in (0, 1):  # whole, cut: each close to the one-pass float64 recurrence
        assert rel_err(r["out"][i], ref["out"]) < out_tol, i
        assert rel_err(r["state"][i], ref["state"]) < state_tol, i
    assert torch.isfinite(r["out"].float()).all()


def test_a_prompt_cut_in_two_calls_continues_from_the_pool():
    """On the CPU (the op's reference): the second call starts from the state the first left in
    the pool, at a cut off the 64-token grid, and both ways match the float64 recurrence."""
    from qla_serving.bench.invariance import prefill_whole_and_cut

    c = prefill_whole_and_cut(torch.float32, length=200, num_qk_heads=2, num_v_heads=4, device="cpu")
    assert 0 < c["cut"] < 200 and c["cut"] % 64 and "fla" not in c
    assert c["qla"]["out"].shape == (2, 200, 4, V) and c["qla"]["state"].shape == (2, 4, V, K)
    _check_whole_and_cut(c, 1e-2, 1e-4)
    with pytest.raises(ValueError, match="cut=200"):
        prefill_whole_and_cut(torch.float32, length=200, cut=200, num_qk_heads=2, num_v_heads=4, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_continue_a_prompt_cut_in_two_calls(pool_dtype):
    """The kernels, a 3000-token prompt at 16/32 heads whole and cut at a random place: both within
    tolerance of the float64 recurrence (a continuation that read the pool wrong would not be)."""
    from qla_serving.bench.invariance import prefill_whole_and_cut

    c = prefill_whole_and_cut(pool_dtype, length=3000)
    _check_whole_and_cut(c, 1e-2, 1e-2)  # the prefill tests' tolerance (tests/test_prefill_kernel.py)


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_prefill_planned_per_sequence_is_the_same_bits_alone_and_beside(pool_dtype, monkeypatch):
    """``QLA_CP_PER_SEQUENCE=1``: the 4096-token sequence is split alone and between two others
    alike, so AutoCP stays on and the bits are the same."""
    from qla_serving.bench.invariance import batch_invariant, prefill_alone_and_beside

    monkeypatch.delenv("QLA_CP_SEGMENT_TOKENS", raising=False)
    monkeypatch.setenv("QLA_CP_PER_SEQUENCE", "1")
    with batch_invariant(False):
        p = prefill_alone_and_beside(pool_dtype)
    assert p["split"] == [True, True]
    assert torch.equal(p["out"][0], p["out"][1]), "the output depends on the batch"
    assert torch.equal(p["state"][0], p["state"][1]), "the final state depends on the batch"


def test_the_start_up_note_names_the_mode(monkeypatch):
    """The engines' start-up line (``backend.batch_invariant_note``): the flag, the per-sequence
    AutoCP, nothing; the flag wins as it does in the planner."""
    from qla_serving import backend

    monkeypatch.setenv("QLA_BATCH_INVARIANT", "0")
    monkeypatch.setenv("QLA_CP_PER_SEQUENCE", "0")
    assert backend.batch_invariant_note() == ""
    note = backend.batch_invariant_note("--enable-deterministic-inference")  # the engine's switch, on
    assert "AutoCP splits each sequence as it would alone (--enable-deterministic-inference)" in note
    monkeypatch.setenv("QLA_CP_PER_SEQUENCE", "1")
    assert "(QLA_CP_PER_SEQUENCE=1)" in backend.batch_invariant_note()
    monkeypatch.setenv("QLA_BATCH_INVARIANT", "1")
    assert "(QLA_BATCH_INVARIANT=1): no AutoCP" in backend.batch_invariant_note()
    assert "(QLA_BATCH_INVARIANT=1): no AutoCP" in backend.batch_invariant_note("--enable-deterministic-inference")
