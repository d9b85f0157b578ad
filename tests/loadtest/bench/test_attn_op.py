"""The candidate CPU attention kernel (loadtest/bench/attn_op.py): SDPA's attention, row by row."""

import pytest
import torch

from loadtest.bench import attn_op

pytestmark = pytest.mark.skipif(
    not attn_op.available(), reason="the kernel needs AVX-512 BF16 and a compiler"
)


def _case(batch, kv_heads, group, tokens, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, batch + 2, kv_heads, length + 8, 64, generator=g).bfloat16()
    keys, vals = cache[0, 1 : batch + 1, :, :length], cache[1, 1 : batch + 1, :, :length]  # views
    qs = torch.randn(batch, kv_heads, group * tokens, 64, generator=g).bfloat16()
    pos = torch.randint(0, length, (batch, tokens), generator=g)
    mask = (torch.arange(length)[None, None, :] <= pos[:, :, None]).unsqueeze(1)  # [B, 1, T, L]
    return qs, keys, vals, mask


@pytest.mark.parametrize("shape", [(1, 3, 3, 1, 300), (8, 3, 3, 2, 64), (2, 8, 4, 2, 129)])
def test_the_kernel_is_sdpa_to_bf16_rounding(shape):
    qs, keys, vals, mask = _case(*shape)
    mask[0, 0, :, 1] = False  # a hole: the mask is honoured key by key, not only as a prefix
    want = attn_op.reference(qs, keys, vals, mask, 0.125)
    vals[0, :, 1] = float("inf")  # the masked key weighs exactly 0: its value never leaks in
    got = attn_op.attend(qs, keys, vals, mask, 0.125).float()
    assert got.shape == want.shape
    assert (got - want).abs().max() < 0.01  # bf16 output rounding of values ~N(0, 1/L)
    grouped = mask.repeat(1, 1, qs.shape[2] // mask.shape[2], 1)  # one mask row per query row
    assert torch.equal(attn_op.attend(qs, keys, vals, grouped, 0.125).float(), got)


def test_each_row_is_computed_alone():
    """Batch- and width-invariant: a row's output is the same bits alone, in a batch, and as
    one token of a 2-token query."""
    qs, keys, vals, mask = _case(3, 3, 3, 2, 100, seed=1)
    both = attn_op.attend(qs, keys, vals, mask, 0.125)
    alone = attn_op.attend(qs[1:2], keys[1:2], vals[1:2], mask[1:2], 0.125)
    assert torch.equal(alone, both[1:2])
    first = qs[:, :, 0::2]  # token 0 of each grouped query head (rows g * 2 + 0)
    one = attn_op.attend(first, keys, vals, mask[:, :, :1], 0.125)
    assert torch.equal(one, both[:, :, 0::2])


def test_a_row_without_keys_is_zero():
    qs, keys, vals, mask = _case(1, 3, 3, 1, 32)
    mask[:] = False
    assert not attn_op.attend(qs, keys, vals, mask, 0.125).any()
