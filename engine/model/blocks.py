"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, a block table per sequence and
automatic prefix caching. Host-side only: no tensor is touched here.

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
from dataclasses import dataclass, field

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


@dataclass
class Table:
    """One sequence's blocks and how many of its positions are committed."""

    blocks: list[int] = field(default_factory=list)
    length: int = 0  # committed positions
    hashes: list[bytes] = field(default_factory=list)  # of its full blocks, in order


class BlockTables:
    """Every sequence's block table over one :class:`BlockPool`, by key (the sequence's slot).

    The life of a sequence: :meth:`open` (its cached prefix held), :meth:`reserve` before each
    forward writes past its committed length (blocks taken as it grows), :meth:`commit` with the
    tokens of what it keeps (blocks that became full are cached), :meth:`rollback` of positions it
    wrote but does not keep, :meth:`close` (its blocks released, the full ones staying cached).
    ``caching``: automatic prefix caching on (off: no block is ever looked up or cached)."""

    def __init__(self, pool: BlockPool, caching: bool = True):
        self.pool, self.caching = pool, caching
        self.block_size = pool.block_size
        self.tables: dict[int, Table] = {}
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def open(self, key: int, prompt: Sequence[int]) -> int:
        """Start sequence ``key`` on the longest cached prefix of ``prompt``, leaving at least its
        last token to compute (its logits start the output). Returns the positions cached."""
        if key in self.tables:
            raise ValueError(f"sequence {key} already has a block table")
        t = self.tables[key] = Table()
        if not self.caching:
            return 0
        hashes, hit = self.pool.cached_prefix(prompt)
        self.pool.hold(hit)
        t.blocks, t.hashes, t.length = list(hit), hashes[: len(hit)], len(hit) * self.block_size
        self.queries += len(prompt)
        self.hits += t.length
        return t.length

    def fork(self, src: int, dst: int) -> None:
        """Sequence ``dst`` starts as a copy of ``src``'s committed full blocks (a choice of the
        same prompt): they are shared, not copied. The positions of ``src``'s partial last block
        are ``dst``'s to compute or copy (:meth:`partial`)."""
        s = self.tables[src]
        full = s.length // self.block_size
        if dst in self.tables:
            raise ValueError(f"sequence {dst} already has a block table")
        shared = s.blocks[:full]
        self.pool.hold(shared)
        self.tables[dst] = Table(list(shared), full * self.block_size, list(s.hashes[:full]))

    def reserve(self, key: int, upto: int) -> list[int]:
        """Blocks for positions ``[0, upto)`` of ``key`` (taking new ones as needed); returns the
        blocks taken. :class:`PoolExhaustedError`, nothing taken, when the pool lacks them."""
        t = self.tables[key]
        need = self.blocks_for(upto) - len(t.blocks)
        if need <= 0:
            return []
        new = self.pool.take(need)
        t.blocks += new
        return new

    def commit(self, key: int, tokens: Sequence[int]) -> None:
        """Sequence ``key`` keeps positions ``[0, len(tokens))`` holding ``tokens`` (all of its
        tokens so far, as the target has seen them); blocks that became full are cached."""
        t = self.tables[key]
        if len(tokens) > len(t.blocks) * self.block_size:
            raise ValueError(f"commit of {len(tokens)} positions past the blocks reserved")
        t.length = len(tokens)
        if not self.caching:
            return
        first = len(t.hashes)
        for i, h in enumerate(extend_hashes(t.hashes, tokens, self.block_size), first):
            self.pool.cache(t.blocks[i], h)

    def rollback(self, key: int, length: int) -> None:
        """Forget positions ``>= length`` of ``key`` (written by a forward, not kept). Blocks stay
        reserved for the next forward; a cached full block is never rolled into."""
        t = self.tables[key]
        if length > t.length:
            raise ValueError(f"rollback to {length} past committed length {t.length}")
        if length < len(t.hashes) * self.block_size:
            raise ValueError("rollback into a cached block")
        t.length = length

    def close(self, key: int) -> None:
        """Sequence ``key`` ends: its blocks are released last first (full ones stay cached)."""
        t = self.tables.pop(key, None)
        if t is not None:
            self.pool.release(t.blocks[::-1])

    def length(self, key: int) -> int:
        return self.tables[key].length

    def blocks(self, key: int) -> list[int]:
        return self.tables[key].blocks
