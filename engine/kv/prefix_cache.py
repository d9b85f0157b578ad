"""Automatic prefix caching over the slot KV cache: a conversation's next turn, which resends the
history, computes only what is new.

Full blocks of a sequence's committed positions are copied into a pool of blocks
(:class:`~engine.kv.blocks.BlockPool`), keyed by the chained hash of their tokens; a sequence
admitted into a slot gets the longest cached prefix of its prompt copied into the slot and
prefills only the rest. Copying a block costs a fraction of computing it (a memory copy against
every layer's matmuls and attention over the whole context). The last prompt token is always
computed: its logits start the output.

Invariants:

- A block in the pool holds exactly the K/V the target computed for its tokens after its
  prefix: only committed positions are stored, and committed positions are never written again.
- The hash root is salted by how the K/V were computed: blocks of batch-invariant forwards
  (deterministic mode, engine/model/invariant.py) serve only sequences that compute that way,
  so a hit gives them bit-identical K/V to a recompute.
- Nothing is held between calls: every block is free (evictable, least recently used first) once
  a call returns, so the pool never blocks admission; it only forgets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.kv.blocks import ROOT, BlockPool, block_hash, extend_hashes
from engine.kv.kv_cache import SlotKVCache, zeros

INVARIANT_ROOT = block_hash(ROOT, [-1])  # the root of blocks computed batch-invariantly


class CachedPrefixes:
    """What both prefix caches keep about the sequences (this one over slots, and
    engine/kv/paged_prefix.py's in the paged cache's own blocks): each slot's hashes of its
    full committed blocks, the longest cached prefix of a prompt, and the counters."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.block_size = pool, block_size
        self.known: dict[int, list[bytes]] = {}  # slot -> hashes of its full committed blocks
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached

    def _lookup(self, slot: int, prompt: Sequence[int], invariant: bool) -> list[int]:
        """The blocks of the longest cached prefix of ``prompt`` (whole blocks, leaving its last
        token to compute), held once more; ``slot`` now knows their hashes."""
        hashes, hit = self.pool.cached_prefix(prompt, INVARIANT_ROOT if invariant else ROOT)
        self.queries += len(prompt)
        self.known[slot] = hashes[: len(hit)]
        self.pool.hold(hit)
        return hit

    def _new_full_blocks(
        self, slot: int, tokens: Sequence[int] | np.ndarray, invariant: bool
    ) -> list[tuple[int, bytes]]:
        """(index in the slot, hash) of the blocks of ``slot`` that ``tokens`` (its committed
        positions) made full since it last said."""
        known = self.known.setdefault(slot, [])
        first = len(known)
        new = extend_hashes(known, tokens, self.block_size, INVARIANT_ROOT if invariant else ROOT)
        return list(enumerate(new, first))

    def forget(self, slot: int) -> None:
        """``slot`` was freed: what it stored stays cached."""
        self.known.pop(slot, None)

    def copy_known(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds ``src``'s first ``length`` positions (a choice sharing a prompt)."""
        self.known[dst] = list(self.known.get(src, [])[: length // self.block_size])


class PrefixCache(CachedPrefixes):
    """A pool of ``num_blocks`` blocks of ``block_size`` positions beside ``cache``."""

    def __init__(self, cache: SlotKVCache, num_blocks: int, block_size: int = 16):
        super().__init__(BlockPool(num_blocks, block_size), block_size)
        self.cache = cache
        k0 = cache.k[0]  # [slots, kv_heads, max_len + 1, head_dim]
        shape = (num_blocks, k0.shape[1], block_size, k0.shape[3])
        # per layer: [blocks, kv_heads, block_size, head_dim]
        self.k = [zeros(shape, k0.dtype, k0.device) for _ in cache.k]
        self.v = [zeros(shape, k0.dtype, k0.device) for _ in cache.v]

    @property
    def tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def restore(self, slot: int, prompt: Sequence[int], invariant: bool = False) -> int:
        """Copy the longest cached prefix of ``prompt`` (whole blocks, leaving its last token to
        compute) into the freshly allocated ``slot`` and commit it. Returns its length."""
        hit = self._lookup(slot, prompt, invariant)
        if not hit:
            return 0
        self.pool.release(hit[::-1])  # used now: evicted last, its tail before its head
        n, dev = len(hit) * self.block_size, self.k[0].device
        ids = torch.tensor(hit, device=dev)
        cache = self.cache
        slot_t, pos = torch.full((n,), slot, device=dev), torch.arange(n, device=dev)  # [n]
        for pool, layer in zip(self.k + self.v, cache.k + cache.v):
            blocks = pool[ids]  # [hit, kv_heads, bs, head_dim]
            rows = blocks.transpose(1, 2).reshape(n, blocks.shape[1], -1)  # [n, kv_heads, head_dim]
            cache.scatter(layer, slot_t, pos, rows)
        cache.commit(slot, n)
        self.hits += n
        return n

    def store(self, slot: int, tokens: Sequence[int] | np.ndarray, invariant: bool = False) -> None:
        """``tokens`` are the first positions ``slot`` has committed: cache its full blocks that
        are not cached yet (a block another sequence cached is only marked used)."""
        bs = self.block_size
        taken: list[tuple[int, int, bytes]] = []  # (pool block, the slot's block index, hash)
        for i, parent in self._new_full_blocks(slot, tokens, invariant):
            cached = self.pool.lookup([parent])
            if cached:
                self.pool.hold(cached)
                self.pool.release(cached)
            elif len(taken) < self.pool.num_blocks:
                taken.append((self.pool.take(1)[0], i, parent))  # held until copied
        if not taken:
            return
        dev = self.k[0].device
        ids = torch.tensor([b for b, _, _ in taken], device=dev)
        pos = torch.tensor([i * bs + j for _, i, _ in taken for j in range(bs)], device=dev)
        slot_t = torch.full_like(pos, slot)
        for pool, layer in zip(self.k + self.v, self.cache.k + self.cache.v):
            rows = self.cache.gather(layer, slot_t, pos)  # [taken * bs, kv_heads, head_dim]
            pool[ids] = rows.view(len(taken), bs, *rows.shape[1:]).transpose(1, 2)
        for b, _, h in taken:
            self.pool.cache(b, h)
        self.pool.release([b for b, _, _ in taken][::-1])
