"""engine/kv/prefix_cache.py on a slot cache of random K/V: a stored prefix restores into
another slot position for position, whole blocks only and never the prompt's last token; blocks
of batch-invariant forwards serve only sequences that compute that way; a full pool forgets its
least recently used blocks."""

import numpy as np
import torch

from engine.kv.kv_cache import SlotKVCache
from engine.kv.prefix_cache import PrefixCache

BS = 4


def cache_and_prefix(blocks: int = 8) -> tuple[SlotKVCache, PrefixCache]:
    cache = SlotKVCache(2, 3, 2, 8, 64, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache, PrefixCache(cache, blocks, BS)


def same_positions(cache: SlotKVCache, a: int, b: int, n: int) -> bool:
    return all(torch.equal(t[a, :, :n], t[b, :, :n]) for t in cache.k + cache.v)


def test_a_stored_prefix_restores_position_for_position():
    cache, prefix = cache_and_prefix()
    tokens = list(range(30, 41))  # 11 tokens: 2 full blocks
    cache.allocate(0)
    cache.commit(0, 11)
    prefix.store(0, tokens)
    assert prefix.pool.num_cached() == 2
    cache.allocate(1)
    assert not same_positions(cache, 0, 1, 8)
    assert prefix.restore(1, tokens + [7, 7]) == 8  # whole blocks of the prompt
    assert same_positions(cache, 0, 1, 8) and cache.lengths[1] == 8
    assert not same_positions(cache, 0, 1, 9)  # nothing past the blocks
    assert prefix.hits == 8 and prefix.queries == 13


def test_the_last_prompt_token_is_never_restored():
    cache, prefix = cache_and_prefix()
    tokens = list(range(8))
    cache.allocate(0)
    cache.commit(0, 8)
    prefix.store(0, tokens)
    cache.allocate(1)
    assert prefix.restore(1, tokens) == 4  # the second block holds the last token


def test_int64_arrays_and_lists_hash_alike():
    cache, prefix = cache_and_prefix()
    cache.allocate(0)
    cache.commit(0, 8)
    prefix.store(0, np.arange(8, dtype=np.int64))  # a sequence's token array
    cache.allocate(1)
    assert prefix.restore(1, list(range(9))) == 8


def test_invariant_blocks_serve_only_invariant_sequences():
    cache, prefix = cache_and_prefix()
    tokens = list(range(9))
    cache.allocate(0)
    cache.commit(0, 9)
    prefix.store(0, tokens, invariant=True)
    cache.allocate(1)
    assert prefix.restore(1, tokens) == 0
    cache.free(1)
    cache.allocate(1)
    assert prefix.restore(1, tokens, invariant=True) == 8


def test_a_full_pool_forgets_the_least_recently_used_prefix():
    cache, prefix = cache_and_prefix(blocks=2)
    a, b = list(range(100, 105)), list(range(200, 205))  # one full block each
    for slot, toks in ((0, a), (1, b)):
        cache.allocate(slot)
        cache.commit(slot, 5)
        prefix.store(slot, toks)
    cache.allocate(2)
    assert prefix.restore(2, a) == 4  # a used again: b is now the least recently used
    prefix.forget(2)
    cache.free(2)
    cache.allocate(2)
    cache.commit(2, 5)
    prefix.store(2, list(range(300, 305)))  # a third prefix: b is evicted
    prefix.forget(2)
    cache.free(2)
    cache.allocate(2)
    assert prefix.restore(2, b) == 0
    assert prefix.restore(2, a) == 4
    assert prefix.pool.evictions == 1
