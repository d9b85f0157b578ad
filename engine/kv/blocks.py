"""Blocks of KV positions and their bookkeeping: a pool of fixed-size blocks with ref counts, and
the chained hashes that key automatic prefix caching. Host-side only: no tensor is touched here.
The paged KV cache (engine/kv/paged_kv.py) keeps each sequence's block table; both prefix
caches (engine/kv/prefix_cache.py, engine/kv/paged_prefix.py) key their blocks here.

Terms, used wherever blocks are:

- **block**: ``block_size`` consecutive positions' K/V in every layer; position ``p`` of a
  sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``.
- **full block**: all its positions committed. A full block is keyed by its **hash**,
  ``block_hash(parent's hash, its token ids)``: equal hashes mean equal token prefixes (a 128-bit
  BLAKE2b digest: a client cannot craft two prompts whose blocks collide). The root's hash may be
  salted: K/V computed one way (the batch-invariant forward of deterministic mode) never serve a
  sequence that computes them another.
- **ref count**: how many sequences hold the block. A block with ref count 0 is free; a free block
  that still has a hash is **cached**: a new sequence whose prompt starts with the same tokens
  takes it instead of computing it again, until the pool needs the block for something else.
- Free blocks wait in least-recently-freed order and are reused from the oldest: a cached block
  is evicted only when no block was free longer. A sequence frees its blocks last first, so its
  tail is evicted before the prefix that other requests are likelier to share.

Invariants: a block is in the free queue iff its ref count is 0; the hash map points only at
blocks that carry that hash; a block with a hash is never written (its positions are committed in
every sequence that holds it, and a sequence writes only past its committed length).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT = b"root"  # the parent hash of a sequence's first block (unsalted)


def block_hash(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """The hash of a full block of ``tokens`` (ints, or an int64 array) after the block whose hash
    is ``parent``."""
    if isinstance(tokens, np.ndarray):
        data = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    else:
        data = array("q", tokens).tobytes()
    return hashlib.blake2b(data, digest_size=16, key=parent).digest()


def prefix_hashes(
    tokens: Sequence[int] | np.ndarray, block_size: int, parent: bytes = ROOT
) -> list[bytes]:
    """The hashes of the full blocks of ``tokens`` (a sequence from position 0)."""
    return extend_hashes([], tokens, block_size, parent)


def extend_hashes(
    known: list[bytes], tokens: Sequence[int] | np.ndarray, block_size: int, root: bytes = ROOT
) -> list[bytes]:
    """Append to ``known`` (the hashes of the first full blocks of ``tokens``, chained from
    ``root``) those of the full blocks after them; returns the ones appended."""
    parent = known[-1] if known else root
    new = []
    for i in range(len(known), len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        new.append(parent)
    known += new
    return new


class PoolExhaustedError(RuntimeError):
    """No block is free: the scheduler preempts a sequence (or waits) before asking again."""


@dataclass
class Block:
    id: int
    ref: int = 0  # sequences holding it
    hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions, their ref counts and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a pool needs at least one block of at least one position")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref-count-0 blocks, least recently freed first (cached ones among them: evictable)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> the block holding that prefix
        self.evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_free(self) -> int:
        """Blocks a sequence can take now (free, cached ones included)."""
        return len(self._free)

    def num_cached(self) -> int:
        return len(self._cached)

    def take(self, n: int) -> list[int]:
        """``n`` blocks for new positions, each held once; cached ones are evicted (oldest free
        first). :class:`PoolExhaustedError` (nothing taken) if fewer than ``n`` are free."""
        if n > len(self._free):
            raise PoolExhaustedError(f"{n} blocks asked, {len(self._free)} free")
        ids = []
        for _ in range(n):
            i, _ = self._free.popitem(last=False)
            b = self.blocks[i]
            if b.hash is not None:  # evict: its prefix is no longer cached
                del self._cached[b.hash]
                b.hash = None
                self.evictions += 1
            b.ref = 1
            ids.append(i)
        return ids

    def hold(self, ids: Sequence[int]) -> None:
        """One more holder of each block in ``ids`` (a cache hit, or a choice sharing a prompt)."""
        for i in ids:
            b = self.blocks[i]
            if b.ref == 0:
                del self._free[i]
            b.ref += 1

    def release(self, ids: Sequence[int]) -> None:
        """One holder fewer of each block in ``ids``, in that order: the ones left unheld join the
        free queue's young end (call with a sequence's blocks last first)."""
        for i in ids:
            b = self.blocks[i]
            if b.ref <= 0:
                raise ValueError(f"block {i} released more often than held")
            b.ref -= 1
            if b.ref == 0:
                self._free[i] = None

    def cache(self, i: int, h: bytes) -> None:
        """Block ``i`` is full and holds the prefix hashed ``h``. Where another block already
        holds it (two sequences computed the same prefix at once), that one stays the cached one
        and ``i`` is freed as usual when released."""
        b = self.blocks[i]
        if b.hash is not None or h in self._cached:
            return
        b.hash = h
        self._cached[h] = i

    def cached_prefix(
        self, prompt: Sequence[int], root: bytes = ROOT
    ) -> tuple[list[bytes], list[int]]:
        """The hashes of ``prompt``'s full blocks that leave its last token to compute (its
        logits start the output), and the blocks of the longest cached run of them."""
        bs = self.block_size
        hashes = prefix_hashes(prompt[: (len(prompt) - 1) // bs * bs], bs, root)
        return hashes, self.lookup(hashes)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of ``hashes`` from the first that are cached (not held
        yet: :meth:`hold` them)."""
        out = []
        for h in hashes:
            i = self._cached.get(h)
            if i is None:
                break
            out.append(i)
        return out
