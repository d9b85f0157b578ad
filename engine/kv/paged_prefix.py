"""Automatic prefix caching over the paged KV cache: blocks shared, never copied.

The slot cache keeps cached prefixes in a pool of its own and copies them into a slot on a hit
(engine/kv/prefix_cache.py). Over the paged cache (engine/kv/paged_kv.py) a sequence's full
blocks are themselves the cache, as in vLLM: once a block is full and committed it is keyed by
the chained hash of its tokens (engine/kv/blocks.py); when its sequence ends the block stays
in the pool's free queue with its K/V and its hash, and a new prompt that starts with the same
tokens puts that very block in its table (held again, nothing copied) and prefills only the
rest. The pool evicts a cached block only when it needs a free one, least recently freed first.
The last prompt token is always computed: its logits start the output.

Invariants: a hashed block holds exactly the K/V the target computed for its tokens after its
prefix (only committed full blocks are hashed, and they are never written again); the hash
root is salted by how the K/V were computed (deterministic mode's batch-invariant forwards:
engine/model/invariant.py), so a hit gives such a sequence bit-identical K/V to a recompute.
The interface is :class:`~engine.kv.prefix_cache.PrefixCache`'s (the scheduler calls both).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.kv.paged_kv import PagedKVCache
from engine.kv.prefix_cache import CachedPrefixes


class PagedPrefixCache(CachedPrefixes):
    """Prefix caching in ``cache``'s own blocks; ``tokens``: the positions its pool was given
    for it beyond the running sequences' budget (reported as the cache's size)."""

    def __init__(self, cache: PagedKVCache, tokens: int):
        super().__init__(cache.pool, cache.block_size)
        self.cache, self.tokens = cache, tokens

    def restore(self, slot: int, prompt: Sequence[int], invariant: bool = False) -> int:
        """Put the blocks of the longest cached prefix of ``prompt`` (whole blocks, leaving its
        last token to compute) in the freshly allocated ``slot``'s table and commit them.
        Returns its length."""
        hit = self._lookup(slot, prompt, invariant)
        if not hit:
            return 0
        self.cache.append(slot, hit)
        n = len(hit) * self.block_size
        self.cache.commit(slot, n)
        self.hits += n
        return n

    def store(self, slot: int, tokens: Sequence[int] | np.ndarray, invariant: bool = False) -> None:
        """``tokens`` are the first positions ``slot`` has committed: its blocks that became full
        are cached under their hashes (where another block holds a hash already, two sequences
        computed the same prefix at once, and that one stays the cached one)."""
        table = self.cache.tables[slot]
        for i, h in self._new_full_blocks(slot, tokens, invariant):
            self.pool.cache(table[i], h)
