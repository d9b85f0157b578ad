"""The paged KV cache (engine/kv/paged_kv.py, ``kv_layout: paged``): block tables that grow with
a sequence and give their blocks back, a pool sized by the KV budget rather than by slots x
max_len, and every exactness test of the slot cache that matters for it run again over it.

The tests imported below are other modules' own (their docstrings say what each proves: greedy
output equal to plain decoding with every drafter, trees whose accepted path is moved in both
caches, prefix-cache hits, preemption, deterministic mode's bit-identical logprobs, concurrent
requests in the worker, the compiled fast path's graph keys and dynamic shapes (Dynamo's eager
backend), the captured fast path's buffer plumbing on CPU and real CUDA graphs with
``SPECD_TEST_DEVICE=cuda``). The fixture ``paged`` builds every engine they make over a
paged cache and checks, after each, that those engines took blocks and that the ones left
without work hold none: a test passing here ran the paged path."""

import pytest
import torch

from engine.kcontrol.controller import FixedK
from engine.kv.blocks import PoolExhaustedError
from engine.kv.paged_kv import PagedKVCache, pool_blocks
from engine.kv.paged_prefix import PagedPrefixCache
from engine.records.params import SamplingParams, SpecParams
from tests import helpers
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, echo_head
from tests.engine.model.test_cuda_graphs import (  # noqa: F401 -- re-run over a paged cache
    test_captured_engine_equals_eager_target_greedy,
    test_captured_engine_equals_eager_when_sampling,
    test_one_sync_per_round_through_graphs,
)
from tests.engine.model.test_fast_forward import (  # noqa: F401
    test_fast_path_output_equals_eager,
)
from tests.engine.test_lossless import (  # noqa: F401 -- the fixtures its tests take
    head,
    prompts,
    reference,
)
from tests.engine.test_lossless import (
    test_eagle_trees_are_lossless_and_both_caches_follow_the_path as eagle_trees_follow_the_path,
)
from tests.engine.test_preemption import (  # noqa: F401
    test_a_storm_of_preemptions_and_aborts_leaks_nothing,
    test_preempted_sequences_decode_as_plain_greedy,
)
from tests.engine.test_prefix_caching import (  # noqa: F401
    GREEDY,
    test_a_conversation_served_from_the_cache_decodes_as_without_it,
    test_choices_of_a_cached_prompt_share_its_prefill,
    test_deterministic_hits_are_bit_identical_to_a_recompute,
    user_turn,
)
from tests.engine.worker.test_worker import test_concurrent_equals_alone  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread", "paged")


@pytest.fixture
def paged(monkeypatch, request):
    """Every engine ``engine_for`` builds in the test has a paged target cache (unless the test
    asks for slots); after the test, they took blocks, and the ones without work hold none (no
    block leaks). An imported test must have built one."""
    monkeypatch.setattr(helpers, "KV_LAYOUT", "paged")
    first = len(helpers.PAGED_ENGINES)
    yield
    built = helpers.PAGED_ENGINES[first:]
    del helpers.PAGED_ENGINES[first:]
    if request.function.__module__ == __name__ and not built:
        return  # this module's own unit tests
    assert built, "the test built no engine over a paged cache"
    caches = [e.target.cache for e in built]
    assert all(isinstance(c, PagedKVCache) for c in caches)
    assert max(c.peak_blocks for c in caches) > 0, "no forward took a block"
    for e, c in zip(built, caches):
        if not e.has_work() and not any(c.lengths):
            assert c.blocks_held() == 0, f"{c.blocks_held()} blocks held by no sequence"


@pytest.mark.real_model
def test_expanded_eagle_trees_over_the_real_model_move_the_paged_path(
    real_fp32, monkeypatch, request
):
    """tests/engine/test_lossless.py's trees test, EAGLE-2's expansion (paths through nodes
    below a runner-up, deep and at the root), over the paged cache: after every round the
    target's cache equals a fresh prefill, and greedy output is the reference's."""
    fixtures = [request.getfixturevalue(name) for name in ("prompts", "reference", "head")]
    eagle_trees_follow_the_path(real_fp32, *fixtures, monkeypatch, topk=4)


def cache(blocks=6, slots=3, max_len=40, bs=4) -> PagedKVCache:
    return PagedKVCache(
        2, slots, 2, 3, max_len, torch.float32, "cpu", num_blocks=blocks, block_size=bs
    )


def test_a_sequence_takes_blocks_as_it_grows_and_gives_them_back():
    c = cache()
    a, b = c.allocate(), c.allocate()
    c.reserve(a, 5)  # positions 0..4: two blocks of 4
    c.reserve(b, 4)
    c.reserve(a, 8)  # still two
    assert c.tables[a] == [0, 1] and c.tables[b] == [2] and c.blocks_held() == 3
    scratch = c.scratch_block
    assert c.table_t[a, :3].tolist() == [0, 1, scratch] and c.table_t[2].eq(scratch).all()
    # position p of a slot is at block table[p // 4], offset p % 4, in the pool
    pos = torch.tensor([[0, 3, 4, 7]])
    assert c.physical(torch.tensor([[a]]), pos).tolist() == [[0, 3, 4, 7]]
    assert c.physical(torch.tensor([[b]]), pos[:, :2]).tolist() == [[8, 11]]
    # padded queries write to the scratch column, whose table column no sequence reaches
    _, write_pos = c.positions([5], [1], 2)
    assert write_pos.tolist() == [[5, c.scratch_pos]]
    assert c.scratch_pos >= c.max_len
    assert c.physical(torch.tensor([[b]]), write_pos)[0, 1] // 4 == scratch
    c.commit(a, 6)
    with pytest.raises(ValueError, match="past the blocks"):
        c.commit(b, 5)
    with pytest.raises(PoolExhaustedError):  # 3 free blocks, 4 asked: nothing taken
        c.reserve(b, 20)
    assert c.tables[b] == [2] and c.blocks_held() == 3
    c.free(a)  # its blocks back, its table row the scratch block's again
    assert c.blocks_held() == 1 and c.table_t[a].eq(scratch).all() and c.lengths[a] == 0
    c.reserve(b, 20)  # now they are there
    assert len(c.tables[b]) == 5 and c.peak_blocks == 5


def test_copy_move_and_the_slot_interface_read_back_what_was_written():
    c = cache(blocks=10)
    a, b = c.allocate(), c.allocate()
    c.reserve(a, 10)
    x = torch.randn(10, 2, 3)  # [positions, kv_heads, head_dim]
    pos, slot_a = torch.arange(10), torch.full((10,), a)
    for t in c.k + c.v:
        c.scatter(t, slot_a, pos, x)
    c.commit(a, 10)
    assert torch.equal(c.gather(c.k[1], slot_a, pos), x)
    assert torch.equal(c.span(c.v[0], torch.tensor([a]), 10)[0], x.transpose(0, 1))
    c.copy(a, b, 7)  # a shared prompt: its full block shared, the 3 positions after it copied
    assert c.lengths[b] == 7 and c.tables[b][0] == c.tables[a][0] != c.tables[b][1]
    assert [c.pool.blocks[i].ref for i in c.tables[b]] == [2, 1]
    assert torch.equal(c.span(c.k[0], torch.tensor([b]), 7)[0], x[:7].transpose(0, 1))
    c.free(b)  # the shared block stays a's
    assert c.pool.blocks[c.tables[a][0]].ref == 1 and c.blocks_held() == 3
    # a tree's accepted path laid out as a chain: positions 8, 9 -> 5, 6 of a (all read first)
    c.move(torch.tensor([a]), torch.tensor([[8, 9, 5]]), torch.tensor([[5, 6, 7]]))
    want = x.clone()
    want[5:8] = x[[8, 9, 5]]
    assert torch.equal(c.gather(c.k[0], slot_a, pos), want)


def test_a_cached_prefix_is_the_same_blocks_until_the_pool_needs_them():
    """A sequence's full committed blocks stay cached after it ends; the next prompt that starts
    the same holds those very blocks (their K/V, nothing copied) and computes the rest; once the
    pool needs them for new positions they are evicted, least recently freed first."""
    c = cache(blocks=8)
    p = PagedPrefixCache(c, 16)
    a = c.allocate()
    tokens = list(range(1, 12))  # 11 tokens: two full blocks of 4
    c.reserve(a, 11)
    x = torch.randn(11, 2, 3)
    c.scatter(c.k[0], torch.full((11,), a), torch.arange(11), x)
    c.commit(a, 11)
    p.store(a, tokens)
    first = c.tables[a][:2]
    p.forget(a)
    c.free(a)
    b = c.allocate()
    assert p.restore(b, tokens[:9] + [99, 98]) == 8  # two blocks; the rest to compute
    assert c.tables[b] == first and c.lengths[b] == 8 and p.hits == 8
    assert torch.equal(c.gather(c.k[0], torch.full((8,), b), torch.arange(8)), x[:8])
    assert p.restore(c.allocate(), [1, 2, 3, 4, 5]) == 4  # shared: both hold the first block
    assert c.pool.blocks[first[0]].ref == 2
    c.free(b)
    c.free(1 - b if b < 2 else 0)
    c.reserve(c.allocate(), 8 * 4)  # every block: the cached ones evicted
    assert c.pool.evictions == 2 and p.restore(c.allocate(), tokens) == 0


def test_the_pool_follows_the_budget_not_slots_times_the_context():
    """Llama-3.1-8B's GPU config: 32 slots x 8,192 positions reserve 34 GB as slots; a paged
    pool for a budget of 65,536 positions is a quarter of that (plus two blocks a slot and the
    calibration's twelve)."""
    slots, max_len, budget = 32, 8192, 65536
    blocks = pool_blocks(budget, slots)
    assert blocks * 16 == budget + 2 * 16 * slots + 12 * 16
    per_position = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x kv_heads x head_dim x bf16 bytes
    as_slots, pool = slots * (max_len + 1) * per_position, (blocks + 1) * 16 * per_position
    assert as_slots > 34e9 and pool < 0.26 * as_slots
    c = PagedKVCache(1, 4, 1, 2, 64, torch.float32, "cpu", num_blocks=pool_blocks(100, 4))
    assert c.bytes == 2 * (pool_blocks(100, 4) + 1) * 16 * 2 * 4  # (K, V) x pool x 2 floats


def test_trees_preemption_and_the_prefix_cache_over_a_small_pool_decode_as_the_slot_engine():
    """The EAGLE-3 head's trees (a chain of 3 and 4 leaves), a budget of one context for four
    sequences (preempted and recomputed, from the prefix cache where it kept them): greedy
    output equals plain decoding over the slot cache, and the pool holds the budget's and the
    prefix cache's blocks."""
    target = helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)
    max_len = 128
    e = helpers.engine_for(
        target, "eagle3", slots=4, max_len=max_len, head=echo_head(target),
        controller=FixedK(3, 4), prefix_cache=256, kv_budget=max_len,
    )  # fmt: skip
    plain = helpers.engine_for(target, None, slots=4, max_len=max_len, kv_layout="slots")
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(1, VOCAB, (25 + 4 * i,), generator=g).tolist() for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    got = e.generate(ps, params, SpecParams(k=3))
    assert [s.output_ids for s in got] == [s.output_ids for s in plain.generate(ps, params)]
    helpers.assert_speculated(got)
    assert sum(s.tree_rounds for s in got) > 0 and sum(s.preemptions for s in got) > 0
    assert any(s.cached_tokens for s in got)
    c = e.target.cache
    assert isinstance(c, PagedKVCache) and c.num_blocks == pool_blocks(max_len + 256, 4)
    assert 0 < c.peak_blocks <= c.num_blocks and c.blocks_held() == 0


def test_a_conversation_beside_traffic_that_evicts_its_blocks_stays_exact(models):
    """Between a conversation's turns, other prompts fill the pool: the conversation's cached
    blocks are evicted (least recently freed first), its hits are partial or none, and its
    greedy output stays what an engine without a prefix cache decodes."""
    on = helpers.engine_for(
        models, "layers", slots=4, max_len=256, prefix_cache=16, kv_budget=256, num_layers=2
    )
    off = helpers.engine_for(models, "layers", slots=4, max_len=256, num_layers=2)
    g = torch.Generator().manual_seed(9)
    traffic = [torch.randint(1, 60, (90,), generator=g).tolist() for _ in range(4)]
    fill = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    spec = SpecParams(k=3)
    runs = []
    for e in (on, off):
        history: list[int] = []
        seqs = []
        for turn in range(4):
            prompt = history + user_turn(turn)
            seqs.append(e.generate([prompt], GREEDY, spec)[0])
            history = prompt + seqs[-1].output_ids
            if e is on:  # the traffic between turns
                e.generate(traffic, fill, spec)
        runs.append(seqs)
    cached, plain = runs
    assert [s.output_ids for s in cached] == [s.output_ids for s in plain]
    helpers.assert_speculated(cached)
    assert on.scheduler.prefix.pool.evictions > 0
    full = sum((len(s.prompt_ids) - 1) // 16 * 16 for s in cached[1:])
    assert sum(s.cached_tokens for s in cached[1:]) < full  # some of the history recomputed
