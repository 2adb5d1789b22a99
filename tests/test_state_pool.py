"""StatePool: unit checks and a 10^5-operation random property test against a plain model.

The model is pure Python: a dict slot -> tag (a float written into every element of the
slot's state in every layer). Each allocation or fork writes a fresh tag, so any aliasing
(two live slots sharing memory) or lost copy shows up as a tag mismatch.
"""

import random

import pytest
import torch

from qla_serving.state import PoolExhaustedError, SlotError, StateCheckpoint, StatePool


def test_shapes_bytes_and_zeroed_allocation():
    pool = StatePool(num_slots=4, num_v_heads=3, head_v_dim=8, head_k_dim=16, num_layers=2, dtype=torch.bfloat16)
    assert [tuple(t.shape) for t in pool.layers] == [(4, 3, 8, 16)] * 2
    assert pool.bytes_per_slot == 2 * 3 * 8 * 16 * 2
    s = pool.allocate()
    pool.layers[1][s].fill_(3.0)
    pool.free(s)
    s2 = pool.allocate()
    assert s2 == s  # most recently freed slot is reused first
    assert all(float(t[s2].abs().max()) == 0 for t in pool.layers), "allocate(zero=True) must clear the state"


def test_view_over_engine_tensor_is_not_a_copy():
    # vLLM-like: the state is a view into a larger per-slot buffer (slot stride > HV*V*K).
    buf = torch.zeros(5, 2 * 4 * 4 + 7)
    view = buf[:, 7:].view(5, 2, 4, 4)
    assert view.stride(0) > 2 * 4 * 4
    pool = StatePool.from_tensors([view])
    assert pool.num_free == 5
    a = pool.allocate()
    pool.layers[0][a].fill_(1.5)
    b = pool.fork(a)
    assert float(buf[b, 7:].min()) == 1.5 and float(buf[b, :7].abs().max()) == 0
    pool.reset(a)
    assert float(buf[a].abs().max()) == 0


def test_misuse_raises_with_the_constraint():
    pool = StatePool(num_slots=2, num_v_heads=1, head_v_dim=2, head_k_dim=2)
    a = pool.allocate()
    with pytest.raises(SlotError, match="out of range"):
        pool.free(7)
    with pytest.raises(SlotError, match="out of range"):
        pool.fork(-1)
    with pytest.raises(SlotError, match="not allocated"):
        pool.reset(1 - a)
    pool.allocate()
    with pytest.raises(PoolExhaustedError, match="0 of 2 are free"):
        pool.allocate()
    pool.free(a)
    with pytest.raises(SlotError, match="not allocated"):
        pool.free(a)  # double free
    with pytest.raises(SlotError, match="not allocated"):
        pool.checkpoint(a)  # use after free
    with pytest.raises(SlotError, match="twice"):
        pool.free([1 - a, 1 - a])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        StatePool(num_slots=1, num_v_heads=1, dtype=torch.float16)
    with pytest.raises(ValueError, match="contiguous"):
        StatePool.from_tensors(torch.zeros(2, 1, 4, 4).transpose(2, 3))
    assert pool.slot_indices([1 - a], pad_to=3).tolist() == [1 - a, -1, -1]


def test_random_operations_against_model():
    rng = random.Random(torch.initial_seed())
    num_slots, layers = 24, 2
    pool = StatePool(num_slots=num_slots, num_v_heads=1, head_v_dim=2, head_k_dim=2, num_layers=layers)
    model: dict[int, float] = {}  # live slot -> tag held in every element of its state
    ckpts: list[tuple[StateCheckpoint, float]] = []
    next_tag = [0.0]

    def tag(slot):
        next_tag[0] += 1.0
        for t in pool.layers:
            t[slot].fill_(next_tag[0])
        model[slot] = next_tag[0]

    def read(slot):
        vals = {float(x) for t in pool.layers for x in t[slot].flatten()}
        assert len(vals) == 1, f"slot {slot} holds mixed values {vals}"
        return vals.pop()

    def free_slot():
        return rng.choice([s for s in range(num_slots) if s not in model])

    misuse = 0
    for step in range(100_000):
        op = rng.random()
        live = list(model)
        if op < 0.25:  # allocate
            if len(model) == num_slots:
                with pytest.raises(PoolExhaustedError):
                    pool.allocate()
                misuse += 1
            else:
                s = pool.allocate(zero=rng.random() < 0.5)
                assert s not in model and 0 <= s < num_slots
                tag(s)
        elif op < 0.45:  # free
            if live:
                s = rng.choice(live)
                pool.free(s)
                del model[s]
        elif op < 0.60:  # fork into a new slot or an existing one
            if live and len(model) < num_slots and rng.random() < 0.7:
                src = rng.choice(live)
                dst = pool.fork(src)
                assert dst not in model
                model[dst] = model[src]
                assert read(dst) == model[src]
                tag(dst)  # the copy must be independent of its source
                assert read(src) == model[src]
            elif len(live) >= 2:
                src, dst = rng.sample(live, 2)
                pool.fork(src, dst)
                model[dst] = model[src]
        elif op < 0.70:  # checkpoint
            if live:
                s = rng.choice(live)
                ckpts.append((pool.checkpoint(s), model[s]))
                ckpts = ckpts[-8:]
        elif op < 0.78:  # restore
            if live and ckpts:
                s = rng.choice(live)
                ck, value = rng.choice(ckpts)
                pool.restore(s, ck)
                model[s] = value
        elif op < 0.82:  # reset
            if live:
                s = rng.choice(live)
                pool.reset(s)
                model[s] = 0.0
        else:  # misuse: every kind must raise and change nothing
            misuse += 1
            kind = rng.randrange(6)
            if kind == 0:
                with pytest.raises(SlotError):
                    pool.free(rng.choice([num_slots, num_slots + 5, -1]))
            elif len(model) == num_slots:
                with pytest.raises(PoolExhaustedError):
                    pool.allocate(1)
            else:
                s = free_slot()
                call = [lambda: pool.free(s), lambda: pool.fork(s), lambda: pool.reset(s),
                        lambda: pool.checkpoint(s), lambda: pool.slot_indices([s])][kind - 1]
                with pytest.raises(SlotError, match="not allocated"):
                    call()
        assert pool.num_allocated == len(model) and pool.num_free == num_slots - len(model), f"leak at step {step}"
        if step % 2000 == 0:
            for s, value in model.items():
                assert read(s) == value, f"step {step}: slot {s} lost its state"
    assert set(pool.allocated_slots()) == set(model)
    for s, value in model.items():
        assert read(s) == value
    pool.free(list(model))
    assert pool.num_free == num_slots  # no leak
    assert misuse > 1000
