import pytest
import torch

from engine.kv.kv_cache import CacheFullError, SlotKVCache


def make(slots=2):
    return SlotKVCache(
        num_layers=2,
        num_slots=slots,
        kv_heads=1,
        head_dim=4,
        max_len=8,
        dtype=torch.float32,
        device="cpu",
    )


def test_allocate_free_accounting():
    c = make(2)
    a, b = c.allocate(), c.allocate()
    assert {a, b} == {0, 1} and c.num_free() == 0
    with pytest.raises(CacheFullError):
        c.allocate()
    c.commit(a, 5)
    c.commit(b, 3)
    assert c.used_tokens() == 8
    c.free(a)
    assert c.used_tokens() == 3 and c.num_free() == 1
    c.free(a)  # double free is harmless
    assert c.num_free() == 1
    assert c.allocate() == a and c.lengths[a] == 0


def test_specific_slot_for_mirrored_draft_cache():
    c = make(3)
    assert c.allocate(2) == 2 and c.allocate() == 0


def test_rollback_only_backwards_and_commit_bounded():
    c = make(1)
    s = c.allocate()
    c.commit(s, 6)
    c.rollback(s, 4)
    assert c.lengths[s] == 4
    with pytest.raises(ValueError):
        c.rollback(s, 5)
    with pytest.raises(ValueError):
        c.commit(s, 9)


def test_scratch_column_and_zero_init():
    c = make(1)
    assert len(c.k) == len(c.v) == 2 and c.scratch_pos == 8
    assert all(t.shape == (1, 1, 9, 4) for t in c.k + c.v)
    assert len({t.data_ptr() for t in c.k + c.v}) == 4  # a tensor of its own per layer
    assert all(int(t.count_nonzero()) == 0 for t in c.k + c.v) and c.bytes == 2 * 2 * 9 * 4 * 4
