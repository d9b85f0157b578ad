"""The paged KV cache: one pool of fixed-size blocks, a block table per slot (``kv_layout:
paged``), for devices where the slot cache's memory would be reserved whole (CUDA).

On CPU the slot cache's pages are resident only where written and go back to the kernel when a
sequence ends (engine/kv/kv_cache.py: the OS's page table is its block table). A CUDA
allocation is resident whole, so there ``max_running x max_model_len`` positions would be held
for the worst case (32 GB for Llama-3.1-8B at 32 x 8,192). Here memory is the pool, sized by the
positions the running sequences may hold (``kv_cache_tokens``, the scheduler's budget), and a
sequence takes blocks as it grows, as vLLM's block tables do.

Terms:

- **block**: ``block_size`` consecutive positions of one slot, in every layer. Position ``p`` of
  slot ``s`` lives in block ``table[s][p // block_size]`` at offset ``p % block_size``, i.e. at
  the pool's **physical** position ``block * block_size + p % block_size``.
- **scratch block**: the pool's last block, never handed out. Every table entry not backed by a
  block points at it, and the scratch column (:attr:`scratch_pos`, where padded queries write)
  lies in a table column no position of a sequence reaches: padding writes land there, and
  what a row reads past its blocks is finite and masked out by position.

Layout: per layer ``[positions of the pool, kv_heads, head_dim]``, position-major, so a forward's
K/V rows ``[batch, q, kv_heads, head_dim]`` are written by one index and a row's keys are read as
``pool[physical]`` ``[batch, kv_len, kv_heads, head_dim]`` (attention takes its transpose, a view).
The block tables live on the device as ``table_t`` ``[slots, columns]`` (updated in place, without a
device sync, when a slot takes or frees blocks), so a captured CUDA graph translates positions
itself and stays valid as tables change.

Blocks are shared: the choices of one prompt hold its full blocks together (:meth:`copy`), and
with prefix caching (engine/kv/paged_prefix.py) a full block keeps its K/V after its sequence
ends, for the next prompt that starts the same, until the pool needs it (:class:`BlockPool`).

Invariants: a block's ref count is the number of slot tables that hold it, and a block of ref
count 0 is free (cached or not); a block that more than one slot holds, or that is cached, lies
wholly below the committed length of every slot that holds it, so it is never written again (a
slot writes only past its committed length); a freed slot's table row points at the scratch
block; positions past a slot's committed length hold stale values that the causal mask by
position never lets a valid query read, as in the slot cache.
"""

from __future__ import annotations

import torch

from engine.kv.blocks import BlockPool
from engine.kv.kv_cache import SlotKVCache, Slots, zeros
from engine.transfer import to_device


class PagedKVCache(Slots):
    """``num_blocks`` blocks of ``block_size`` positions shared by ``num_slots`` slots of up to
    ``max_len`` positions each; keys are gathered through the block tables."""

    paged = True

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        num_blocks: int,
        block_size: int = 16,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a paged cache needs at least one block of at least one position")
        super().__init__(num_layers, num_slots, max_len)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        # table columns: every position < max_len, then one column for the scratch position
        self.table_cols = -(-max_len // block_size) + 1
        self.scratch_block = num_blocks
        shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)
        # zeros, not empty: a masked-out key is still multiplied by 0 (0 * NaN = NaN); on CPU
        # calloc'd, resident only where written (kv_cache.zeros)
        # per layer: [(num_blocks + 1) * block_size, kv_heads, head_dim]
        self.k = [zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeros(shape, dtype, device) for _ in range(num_layers)]
        # [slots, table_cols]: each slot's blocks, the scratch block where it has none
        self.table_t = torch.full(
            (num_slots, self.table_cols), num_blocks, dtype=torch.long, device=device
        )
        self.tables: list[list[int]] = [[] for _ in range(num_slots)]  # host copy of table_t
        # the blocks' ref counts, their free queue (least recently freed first) and the hashes
        # of the full ones the prefix cache keeps (engine/kv/paged_prefix.py)
        self.pool = BlockPool(num_blocks, block_size)
        self.peak_blocks = 0  # the most blocks held at once

    # -- blocks ------------------------------------------------------------------------------------
    @property
    def scratch_pos(self) -> int:
        """The logical column padded queries write to: its table column is the last, always the
        scratch block."""
        return (self.table_cols - 1) * self.block_size

    def blocks_held(self) -> int:
        """Blocks some sequence holds (the rest are free, cached ones among them)."""
        return self.num_blocks - self.pool.num_free()

    def free(self, slot: int) -> None:
        """Hand the slot back and release its blocks, last first (the tail is evicted before
        the prefix other requests are likelier to share; cached ones stay cached)."""
        if slot in self._free:
            return
        blocks = self.tables[slot]
        if blocks:
            self.pool.release(blocks[::-1])
            self.table_t[slot, : len(blocks)] = self.scratch_block
            self.tables[slot] = []
        self._hand_back(slot)

    def reserve(self, slot: int, upto: int) -> None:
        """Blocks for positions ``[0, upto)`` of ``slot``, taken from the pool as it grows (a
        cached free block is evicted, least recently freed first); ``PoolExhaustedError``
        (nothing taken) when the pool lacks them (the pool is sized so that it never does:
        :func:`pool_blocks`)."""
        if upto > self.max_len + 1:
            raise ValueError(f"position {upto - 1} past the cache's max_len {self.max_len}")
        need = min(-(-upto // self.block_size), self.table_cols - 1) - len(self.tables[slot])
        if need > 0:
            self.append(slot, self.pool.take(need))

    def append(self, slot: int, blocks: list[int]) -> None:
        """``blocks`` (held for ``slot``) follow its table's last."""
        have = self.tables[slot]
        cols = slice(len(have), len(have) + len(blocks))
        self.table_t[slot, cols] = to_device(blocks, torch.long, self.device)
        have += blocks
        self.peak_blocks = max(self.peak_blocks, self.blocks_held())

    def rollback(self, slot: int, length: int) -> None:
        """As :meth:`Slots.rollback`, never into a block another sequence holds or the prefix
        cache keys: the next forward writes from ``length`` on, and such a block's K/V are
        shared (ValueError)."""
        i = length // self.block_size
        table = self.tables[slot]
        if i < len(table) and length < self.lengths[slot]:
            b = self.pool.blocks[table[i]]
            if b.ref > 1 or b.hash is not None:
                raise ValueError(f"rollback of slot {slot} to {length}: into a shared block")
        super().rollback(slot, length)

    def commit(self, slot: int, length: int) -> None:
        if length > len(self.tables[slot]) * self.block_size:
            raise ValueError(f"commit of {length} positions past the blocks of slot {slot}")
        super().commit(slot, length)

    # -- positions --------------------------------------------------------------------------------
    def physical(self, slots: torch.Tensor | int, pos: torch.Tensor) -> torch.Tensor:
        """The pool positions of logical positions ``pos`` of ``slots`` (broadcast together, e.g.
        ``[batch, 1]`` and ``[batch, q]``; or one slot's number), on the device."""
        bs = self.block_size
        return self.table_t[slots, pos // bs] * bs + pos % bs

    def scatter(self, t: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, x: torch.Tensor):
        t[self.physical(slots, pos)] = x

    def gather(self, t: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return t[self.physical(slots, pos)]

    def span(self, t: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        cols = torch.arange(length, device=slots.device)
        return t[self.physical(slots[:, None], cols[None])].transpose(1, 2)  # [g, kvh, L, hd]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` (just allocated) holds the first ``length`` positions of slot ``src`` (a
        prompt its choices share): ``src``'s full blocks among them are shared, not copied (each
        slot writes only past its committed length, so neither writes them again), and the
        positions of a partial last block are copied into a block of ``dst``'s own."""
        bs, full = self.block_size, length // self.block_size
        shared = self.tables[src][:full]
        self.pool.hold(shared)
        self.append(dst, list(shared))
        if length > full * bs:
            self.reserve(dst, length)
            cols = torch.arange(full * bs, length, device=self.device)
            s, d = self.physical(src, cols), self.physical(dst, cols)  # [length % bs]
            for t in self.k + self.v:
                t[d] = t[s]
        self.lengths[dst] = length

    def move(self, slot_t: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """As :meth:`SlotKVCache.move`: row b's positions ``src[b]`` copied to ``dst[b]`` (all
        read before any is written); the positions lie in blocks the tree's forward reserved."""
        s, d = self.physical(slot_t[:, None], src), self.physical(slot_t[:, None], dst)
        for t in self.k + self.v:
            t[d] = t[s]  # [batch, n, kv_heads, head_dim]


KVCache = SlotKVCache | PagedKVCache  # a runner's cache, by its layout


def pool_blocks(tokens: int, num_slots: int, block_size: int = 16) -> int:
    """Blocks for a pool that holds ``tokens`` positions among ``num_slots`` sequences: the
    scheduler's budget counts a sequence's tokens and the K + 1 its next verify may write (a
    draft tree's verify fits the same K_max + 1 queries), and each slot may hold the unused part
    of a block past them (one block a slot to spare besides); and the adaptive controller's
    calibration (engine/kcontrol/calibration.py: up to 4 free slots of ~40 positions) may run
    beside running sequences."""
    calibration = 4 * -(-48 // block_size)
    return -(-tokens // block_size) + 2 * num_slots + calibration
