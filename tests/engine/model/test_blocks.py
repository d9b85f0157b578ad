"""engine/kv/blocks.py and the sequences' life over it in the paged cache
(engine/kv/paged_kv.py) with its prefix cache (engine/kv/paged_prefix.py): the block pool's
ref counts and free queue, prefix lookup by chained hashes, eviction oldest-freed first, and a
sequence's blocks (restored from a cached prefix, reserved, committed and cached, rolled back,
shared by a choice, freed) without a leaked block. Host bookkeeping only: the K/V the blocks
hold are tests/engine/test_paged_kv.py's."""

import pytest
import torch

from engine.kv.blocks import ROOT, BlockPool, PoolExhaustedError, block_hash, prefix_hashes
from engine.kv.paged_kv import PagedKVCache
from engine.kv.paged_prefix import PagedPrefixCache

BS = 4


class Seqs:
    """Sequences over a paged cache of ``blocks`` blocks of BS positions, by slot, as the engine
    drives them (``caching``: with the prefix cache, else none is looked up or stored)."""

    def __init__(self, blocks: int = 8, caching: bool = True, slots: int = 8):
        self.cache = PagedKVCache(
            1, slots, 1, 1, 64, torch.float32, "cpu", num_blocks=blocks, block_size=BS
        )
        self.pool = self.cache.pool
        self.prefix = PagedPrefixCache(self.cache, 0) if caching else None

    def open(self, slot: int, prompt: list[int]) -> int:
        """Allocate ``slot`` on the longest cached prefix of ``prompt``; the positions cached."""
        self.cache.allocate(slot)
        return self.prefix.restore(slot, prompt) if self.prefix else 0

    def reserve(self, slot: int, upto: int) -> None:
        self.cache.reserve(slot, upto)

    def commit(self, slot: int, tokens: list[int]) -> None:
        self.cache.commit(slot, len(tokens))
        if self.prefix:
            self.prefix.store(slot, tokens)

    def fork(self, src: int, dst: int) -> None:
        """``dst`` a choice of ``src``'s committed prompt."""
        self.cache.allocate(dst)
        n = self.cache.lengths[src]
        self.cache.copy(src, dst, n)
        if self.prefix:
            self.prefix.copy_known(src, dst, n)

    def close(self, slot: int) -> None:
        self.cache.free(slot)
        if self.prefix:
            self.prefix.forget(slot)

    def blocks(self, slot: int) -> list[int]:
        return self.cache.tables[slot]

    def held(self) -> int:
        return sum(b.ref for b in self.pool.blocks)


def test_hashes_chain_and_depend_on_every_token_and_the_parent():
    a = prefix_hashes(list(range(10)), BS)
    assert len(a) == 2  # two full blocks of 4; the last 2 tokens are no block
    assert a[0] == block_hash(ROOT, [0, 1, 2, 3]) and a[1] == block_hash(a[0], [4, 5, 6, 7])
    b = prefix_hashes([0, 1, 2, 3, 4, 5, 6, 9], BS)
    assert b[0] == a[0] and b[1] != a[1]  # a shared first block, a different second
    c = prefix_hashes([9, 1, 2, 3, 4, 5, 6, 7], BS)
    assert c[1] != a[1]  # the same second block after another first: another prefix
    assert prefix_hashes(list(range(8)), BS, parent=b"salt") != a  # a salted root


def test_take_hold_release_and_the_free_queue():
    pool = BlockPool(3, BS)
    a = pool.take(2)
    assert pool.num_free() == 1 and all(pool.blocks[i].ref == 1 for i in a)
    with pytest.raises(PoolExhaustedError):
        pool.take(2)
    assert pool.num_free() == 1  # nothing taken by the refused call
    pool.hold(a[:1])
    pool.release(a[::-1])
    assert pool.blocks[a[0]].ref == 1 and pool.num_free() == 2
    pool.release(a[:1])
    assert pool.num_free() == 3
    with pytest.raises(ValueError):
        pool.release(a[:1])


def test_a_second_request_reuses_the_prompt_and_computes_only_the_rest():
    t = Seqs()
    prompt = list(range(11))  # 2 full blocks and 3 tokens
    assert t.open(0, prompt) == 0
    t.reserve(0, len(prompt))
    t.commit(0, prompt)
    assert t.pool.num_cached() == 2
    t.close(0)
    assert t.held() == 0 and t.pool.num_cached() == 2  # freed, still cached
    assert t.open(1, prompt + [50, 51]) == 8  # the 2 cached blocks; 5 tokens to compute
    assert t.blocks(1) == list(t.pool._cached.values()) and t.cache.lengths[1] == 8
    assert t.prefix is not None and t.prefix.hits == 8 and t.prefix.queries == 11 + 13


def test_at_least_the_last_token_is_computed():
    t = Seqs()
    prompt = list(range(8))  # exactly 2 full blocks
    t.open(0, prompt)
    t.reserve(0, 8)
    t.commit(0, prompt)
    t.close(0)
    assert t.open(1, prompt) == 4  # the second block holds the last token: computed again


def test_generated_tokens_are_cached_for_the_next_turn():
    t = Seqs()
    prompt, answer = list(range(6)), [20, 21, 22, 23, 24]
    t.open(0, prompt)
    t.reserve(0, 6)
    t.commit(0, prompt)
    t.reserve(0, 11)
    t.commit(0, prompt + answer)  # 11 tokens: 2 full blocks, the second holds answer tokens
    t.close(0)
    assert t.open(1, prompt + answer + [7, 8, 9]) == 8


def test_eviction_takes_the_oldest_freed_block_and_a_sequence_frees_its_tail_first():
    t = Seqs(blocks=4)
    p = list(range(100, 109))  # 2 full blocks + 1
    t.open(0, p)
    t.reserve(0, 9)
    t.commit(0, p)
    first, second, partial = t.blocks(0)
    assert first not in (second, partial)
    t.close(0)  # freed last first: partial, second, first
    assert t.pool.num_free() == 4 and t.pool.num_cached() == 2
    t.open(1, [1])
    t.reserve(1, 8)  # 2 blocks: the never-used one, then the partial (oldest freed)
    assert t.blocks(1) == [3, partial]
    assert t.pool.num_cached() == 2 and t.pool.evictions == 0
    t.reserve(1, 12)  # one more: the second block, evicted (its hash gone)
    assert second in t.blocks(1) and t.pool.num_cached() == 1 and t.pool.evictions == 1
    assert t.open(2, p) == 4  # the first block is still cached


def test_a_cached_block_in_use_is_never_evicted():
    t = Seqs(blocks=3)
    p = list(range(9))
    t.open(0, p)
    t.reserve(0, 9)
    t.commit(0, p)
    with pytest.raises(PoolExhaustedError):
        t.reserve(0, 13)  # all 3 blocks are held by the running sequence
    assert len(t.blocks(0)) == 3  # nothing taken by the refused call
    t.close(0)
    assert t.open(1, p) == 8  # holds the 2 cached blocks
    t.reserve(1, 9)
    t.open(2, [5])
    with pytest.raises(PoolExhaustedError):
        t.reserve(2, 8)  # 1 free block left: the hit's blocks are not taken from under it


def test_rollback_keeps_blocks_and_never_enters_a_shared_block():
    t = Seqs()
    p = list(range(6))
    t.open(0, p)
    t.reserve(0, 6 + 4)  # a verify of 4 drafted tokens past the prompt
    t.commit(0, p + [1, 2, 3])  # 9 kept: 2 full blocks, cached, and 1 position of a third
    t.cache.rollback(0, 8)  # back to the third block's start: its own, rewritten next
    assert len(t.blocks(0)) == 3 and t.cache.lengths[0] == 8
    with pytest.raises(ValueError):
        t.cache.rollback(0, 7)  # inside the second, cached block: its next write would change it
    with pytest.raises(ValueError):
        t.cache.rollback(0, 9)  # past what is committed
    u = Seqs(caching=False)  # no hash: a block another sequence holds is refused all the same
    u.open(0, p + [1, 2])
    u.reserve(0, 8)
    u.commit(0, p + [1, 2])
    u.fork(0, 1)  # a choice shares both full blocks
    with pytest.raises(ValueError):
        u.cache.rollback(1, 6)
    u.close(0)  # the choice holds them alone now
    u.cache.rollback(1, 6)
    assert u.cache.lengths[1] == 6


def test_choices_share_the_prompts_full_blocks():
    t = Seqs()
    p = list(range(10))
    t.open(0, p)
    t.reserve(0, 10)
    t.commit(0, p)
    t.fork(0, 1)
    # the full blocks shared, the partial third one copied into a block of the choice's own
    assert t.blocks(1)[:2] == t.blocks(0)[:2] and t.blocks(1)[2] != t.blocks(0)[2]
    assert t.cache.lengths[1] == 10
    assert [t.pool.blocks[i].ref for i in t.blocks(0)] == [2, 2, 1]
    t.close(0)
    t.close(1)
    assert t.held() == 0 and t.pool.num_free() == 8


def test_a_storm_of_sequences_leaks_no_block():
    import random

    rng = random.Random(0)
    t = Seqs(blocks=16)
    live: dict[int, list[int]] = {}
    for _ in range(500):
        slot = rng.randrange(6)
        if slot in live and rng.random() < 0.3:
            t.close(slot)
            del live[slot]
        elif slot in live:
            toks = live[slot] + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            try:
                t.reserve(slot, len(toks))
            except PoolExhaustedError:
                t.close(slot)  # preempted
                del live[slot]
                continue
            t.commit(slot, toks)
            live[slot] = toks
        else:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
            t.open(slot, prompt)
            try:
                t.reserve(slot, len(prompt))
            except PoolExhaustedError:
                t.close(slot)
                continue
            t.commit(slot, prompt)
            live[slot] = prompt
    assert t.prefix is not None and t.prefix.hits > 0  # the small alphabet makes prefixes repeat
    for slot in list(live):
        t.close(slot)
    assert t.held() == 0 and t.pool.num_free() == 16
    assert all(t.pool.blocks[i].hash == h for h, i in t.pool._cached.items())
