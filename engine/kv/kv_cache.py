"""Slot-based static KV cache, shared layout for target and draft models.

Why not transformers' cache classes: a speculative round needs *ragged* rows (each row its own
length, its own number of new tokens, its own number of accepted tokens) and cheap rollback. With a
preallocated slot per running sequence, rollback is just "set the row's length back"; positions
past a row's length hold stale values that the causal mask by position never lets a valid query
read, and the next write overwrites them. The shapes are static (``[slots, kv_heads, max_len + 1,
head_dim]`` per layer), which is what the fast-forward path (torch.compile / CUDA graphs) needs.

Column ``max_len`` of every slot is a scratch column: padded query positions (rows shorter than
the longest row of a batch forward) write there, so padding never touches real positions.
Each layer's K and V are tensors of their own (``k[i]``, ``v[i]``), not views of one
``[layers, ...]`` tensor: the compiled path (engine/model/compiled.py) writes a group of layers'
caches in place as inputs of one graph, and views of one shared tensor as such inputs made
inductor copy a whole layer's cache on every write (decode steps orders of magnitude slower).
The committed lengths live on the host as Python ints: they are bookkeeping, never a device sync.

Memory: on CPU the cache is allocated zeroed by ``calloc`` (through numpy), whose large blocks are
fresh pages the kernel maps on first write, so resident memory grows with the tokens actually
cached, not with the ``slots x max_len`` reserved; a freed slot's pages go back to the kernel
(:func:`release`: on Linux they read as zeros after, resident again only when written). The OS's
page table is the block table: each (layer, slot, KV head) is a contiguous run of positions, so
attention reads keys as a view, no gather, and memory follows the tokens held (the scheduler
bounds them: ``kv_cache_tokens``). On CUDA the slots are allocated whole; ``kv_layout: paged``
(engine/kv/paged_kv.py) is the block-table cache for it.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import mmap
import sys

import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on CPU from calloc'd memory, resident only where written (see the docstring)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    try:  # numpy asks for huge pages on big arrays: one write would make 2 MiB resident
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy < 2
        multiarray = importlib.import_module("numpy.core.multiarray")
    _set_madvise_hugepage = multiarray._set_madvise_hugepage  # private, not in numpy's stubs
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    before = _set_madvise_hugepage(False)
    try:
        buf = np.zeros(n, dtype=np.uint8)
    finally:
        _set_madvise_hugepage(before)
    return torch.from_numpy(buf).view(dtype).view(shape)


MADV_DONTNEED = 4  # Linux: the pages are dropped; a private anonymous mapping reads zeros after
_libc: list = []  # ctypes' libc, loaded on first use


def release(t: torch.Tensor) -> None:
    """Give ``t``'s memory (a contiguous CPU tensor) back to the kernel on Linux: the pages lying
    wholly inside it are dropped (they read as zeros and are resident again only where written),
    the parts of pages at its ends are written with zeros. Elsewhere a no-op: what a freed slot
    holds is finite and never read before it is written again, as a rolled-back position's."""
    if t.device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    if not _libc:
        _libc.append(ctypes.CDLL(None, use_errno=True))
    size, start = t.element_size(), t.data_ptr()
    end = start + t.numel() * size
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    flat = t.view(-1)
    if last <= first or _libc[0].madvise(
        ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED
    ):
        flat.zero_()  # smaller than a page, or refused: written
        return
    flat[: (first - start) // size].zero_()
    flat[(last - start) // size :].zero_()


class CacheFullError(RuntimeError):
    pass


def query_positions(
    starts: list[int], counts: list[int], q: int, scratch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-built index tensors ``[batch, q]`` (no device sync) for rows feeding ``counts[b]``
    tokens at ``starts[b]``: the position of every query token, and where its K/V is written
    (padding past a row's count goes to the scratch column ``scratch``)."""
    pos = torch.tensor(
        [[s + min(j, max(n, 1) - 1) for j in range(q)] for s, n in zip(starts, counts)]
    )  # [batch, q]
    valid = torch.tensor([[j < n for j in range(q)] for n in counts])  # [batch, q]
    return pos, torch.where(valid, pos, torch.full_like(pos, scratch))


class Slots:
    """What every KV cache of a runner keeps, whatever its layout: ``num_slots`` sequences of up
    to ``max_len`` positions, handed out and freed, their committed lengths as host ints (never a
    device sync), and the positions of a forward's queries (logical: position ``p`` of a slot).

    A layout adds its tensors (``k``, ``v``: one per layer), :meth:`free`, :meth:`reserve` (before
    a forward writes past a slot's committed length), :meth:`scatter` / :meth:`gather` /
    :meth:`span` (for the code outside the decoder layer that reads or writes K/V by slot and
    position), :meth:`copy` and :meth:`move`: :class:`SlotKVCache` and
    :class:`~engine.kv.paged_kv.PagedKVCache`."""

    paged = False  # whether the decoder layer reads keys through block tables (else by slot)
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    def __init__(self, num_layers: int, num_slots: int, max_len: int):
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        self.lengths = [0] * num_slots  # committed tokens per slot (host ints)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first

    @property
    def scratch_pos(self) -> int:
        """The column padded queries write to (past every position a sequence reaches)."""
        return self.max_len

    @property
    def columns(self) -> int:
        """Positions a row's keys may be read up to (``max_len`` and the scratch column)."""
        return self.max_len + 1

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def num_free(self) -> int:
        return len(self._free)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """Take a free slot (a specific one when given: a draft cache mirrors the target's)."""
        if slot is None:
            if not self._free:
                raise CacheFullError("no free KV cache slot")
            slot = self._free.pop()
        else:
            self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def _hand_back(self, slot: int) -> None:
        """``slot`` is free again (its layout freed what it held)."""
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def used_tokens(self) -> int:
        return sum(self.lengths)

    def positions(
        self, starts: list[int], counts: list[int], q: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`query_positions` of a forward's rows."""
        return query_positions(starts, counts, q, self.scratch_pos)

    def rollback(self, slot: int, length: int) -> None:
        """Forget every position >= ``length`` (they stay in memory but are never read again)."""
        if length > self.lengths[slot]:
            raise ValueError(f"rollback to {length} past committed length {self.lengths[slot]}")
        self.lengths[slot] = length

    def commit(self, slot: int, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"length {length} exceeds the cache's max_len {self.max_len}")
        self.lengths[slot] = length


class SlotKVCache(Slots):
    """A slot of ``max_len + 1`` positions per sequence, in every layer (the module's docstring);
    keys are read as views of the slots."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__(num_layers, num_slots, max_len)
        shape = (num_slots, kv_heads, max_len + 1, head_dim)
        # zeros, not empty: masked-out positions are still multiplied by 0 in attention, and
        # uninitialised memory may hold NaN (0 * NaN = NaN).
        # per layer: [slots, kv_heads, max_len+1, head_dim]
        self.k = [zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [zeros(shape, dtype, device) for _ in range(num_layers)]

    def free(self, slot: int) -> None:
        """Hand the slot back; on Linux CPU its pages go back to the kernel (:func:`release`)."""
        if slot in self._free:
            return
        for t in self.k + self.v:
            release(t[slot])  # [kv_heads, max_len + 1, head_dim], contiguous
        self._hand_back(slot)

    def reserve(self, slot: int, upto: int) -> None:
        """Room for positions ``[0, upto)`` of ``slot``: a slot always has it."""
        if upto > self.max_len + 1:
            raise ValueError(f"position {upto - 1} past the cache's max_len {self.max_len}")

    def scatter(self, t: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, x: torch.Tensor):
        """Write ``x`` ``[n, kv_heads, head_dim]`` at (``slots[i]``, ``pos[i]``) of layer tensor
        ``t`` (one of :attr:`k` / :attr:`v`); slots, pos ``[n]`` long on the device."""
        t[slots, :, pos] = x

    def gather(self, t: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The K (or V) at (``slots[i]``, ``pos[i]``) of layer tensor ``t``:
        ``[n, kv_heads, head_dim]``."""
        return t[slots, :, pos]

    def span(self, t: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Positions ``[0, length)`` of each of ``slots`` ``[g]`` in layer tensor ``t``:
        ``[g, kv_heads, length, head_dim]``."""
        return t[slots, :, :length]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot ``dst`` holds the first ``length`` positions of slot ``src`` (a shared prompt)."""
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]
        self.lengths[dst] = length

    def move(self, slot_t: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In every layer, row b's columns ``src[b]`` are copied to ``dst[b]`` (an accepted path
        of a draft tree, whose nodes were written where the tree put them, laid out as a chain:
        engine/round/tree.py). slot_t ``[batch]``; src, dst ``[batch, n]`` long on the device
        (padding: the scratch column both); all columns are read before any is written."""
        rows = slot_t[:, None]  # [batch, 1]
        for t in self.k + self.v:
            t[rows, :, dst] = t[rows, :, src]  # [batch, n, kv_heads, head_dim]
