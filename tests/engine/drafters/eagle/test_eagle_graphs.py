"""The EAGLE-3 head replayed as CUDA graphs (engine/drafters/eagle/graphs.py): padded buckets give
the eager head's results, padding writes nothing but the scratch column (a smaller call after a
larger one in the same bucket included), shapes past the buckets run eagerly, and an engine
drafting through the captured head keeps greedy output equal to the target's alone. Without
CUDA a replay re-runs the function on the static buffers (the plumbing); with
``SPECD_TEST_DEVICE=cuda`` the graphs are recorded and replayed."""

from __future__ import annotations

import pytest
import torch

from engine.drafters.eagle.drafter import EagleDrafter
from engine.drafters.eagle.graphs import HeadCapture
from engine.drafters.eagle.step import HeadStep, head_forward
from engine.records.params import SamplingParams, SpecParams
from tests import helpers
from tests.eagle_builders import (
    HIDDEN,
    LAYERS,
    VOCAB,
    call,
    eagle_engine,
    prompts,
    random_head,
)

KV_ALIGN = 16


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)


def drafter(
    target, slots: int = 4, q_max: int = 8, extras: int = 0
) -> tuple[EagleDrafter, HeadCapture]:
    """A drafter over a random head with its cache filled at random, and a capture for it
    (``extras``: with masked graphs for a tree's steps)."""
    d = eagle_engine(target, random_head(5), slots=slots, k=3).drafter
    assert isinstance(d, EagleDrafter)
    with torch.inference_mode():
        for t, seed in ((d.cache.k[0], 0), (d.cache.v[0], 1)):  # (generated on the host)
            g = torch.Generator().manual_seed(seed)
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    c = d.cache
    return d, HeadCapture(c.scratch_pos, c.num_slots, KV_ALIGN, c.max_len, q_max, extras)


def test_padded_buckets_give_the_eager_heads_results(target):
    """Rows, q and key lengths that pad up to their buckets (3 -> 4 rows, q 3 -> 4, 40 -> 64
    keys), ingest, chain and a tree's masked step, and exact bucket sizes: outputs, logits and
    the K written are the eager head's; each key is recorded once."""
    d, cap = drafter(target, extras=3)
    shapes = [(3, 1, False, 40), (3, 3, True, 40), (1, 1, True, 19), (4, 4, True, 64),
              (2, 5, True, 100), (1, 1, False, 7), (3, 1, False, 33)]  # fmt: skip
    masked = [(3, 40), (1, 19), (4, 33)]  # rows, keys (q = 1)
    calls = [(r, q, i, kv, False) for r, q, i, kv in shapes] + [
        (r, 1, False, kv, True) for r, kv in masked
    ]
    with torch.inference_mode():
        for i, (rows, q, ingest, kv_len, m) in enumerate(calls):
            ref = call(d, head_forward, rows, q, ingest, kv_len, seed=i, masked=m)
            got = call(d, cap, rows, q, ingest, kv_len, seed=i, masked=m)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert cap.calls == len(calls) and cap.eager_calls == 0
    # 3 -> 4 rows and 33, 40 -> 64 keys; q 3, 4 -> 4; masked: 4 rows over 64 keys, 1 over 32
    assert cap.captures == len(cap.graphs) == 7
    assert (4, 4, 64, True, False) in cap.graphs and (4, 1, 64, False, False) in cap.graphs
    assert (4, 1, 64, False, True) in cap.graphs and (1, 1, 32, False, True) in cap.graphs


def run_calls(d: EagleDrafter, fn, calls) -> tuple[torch.Tensor, torch.Tensor]:
    """``calls``: (slots, start positions, q, ingest) each, written at those positions; returns
    the head cache's K and V after all of them, the cache restored to what it held before."""
    k0, v0 = d.cache.k[0].clone(), d.cache.v[0].clone()
    g = torch.Generator().manual_seed(11)
    dev = d.device
    with torch.inference_mode():
        for slots, starts, q, ingest in calls:
            rows = len(slots)
            width = d.head.fc.in_features if ingest else d.head.config.hidden_size
            x = torch.randn(rows, q, width, generator=g).to(dev)
            ids = torch.randint(0, VOCAB, (rows, q), generator=g).to(dev)
            pos = (torch.tensor(starts)[:, None] + torch.arange(q)).to(dev)  # [rows, q]
            kv = d.kv_idx[: -(-(max(starts) + q) // KV_ALIGN) * KV_ALIGN]
            last = torch.full((rows,), q - 1, device=dev)
            slot_t = torch.tensor(slots, device=dev)
            step = HeadStep(ids, x, last, pos, pos, kv, slot_t, ingest)
            fn(step, d.weights, d.cache.k[0], d.cache.v[0], d.shape)
        after = d.cache.k[0].clone(), d.cache.v[0].clone()
        d.cache.k[0].copy_(k0)
        d.cache.v[0].copy_(v0)
    return after


def test_padding_writes_nothing_but_the_scratch_column(target):
    """A call of four rows, then smaller ones in the same buckets (other slots, other positions,
    rows out of slot order): every cache entry the rows did not write is unchanged, the written
    ones are the eager head's; the stale rows and positions of the larger call write nothing."""
    d, cap = drafter(target)
    # the third call replays the first one's graph with three rows: a stale fourth row (slot 3,
    # position 12) would write the first call's K there again, over the second call's
    calls = [([0, 1, 2, 3], [30, 5, 60, 12], 1, False), ([3], [12], 1, False),
             ([3, 1, 0], [13, 6, 40], 1, False), ([2], [61], 1, False), ([1, 3], [7, 14], 3, True),
             ([0], [32], 2, True)]  # fmt: skip
    before = d.cache.k[0].clone(), d.cache.v[0].clone()
    ref = run_calls(d, head_forward, calls)
    got = run_calls(d, cap, calls)
    written = torch.zeros(d.cache.k[0].shape[0], d.cache.k[0].shape[2], dtype=torch.bool)
    for slots, starts, q, _ in calls:
        for s, st in zip(slots, starts):
            written[s, st : st + q] = True
    written[:, d.cache.scratch_pos] = True  # padding's column: anything may be there
    assert cap.captures == 5 and cap.eager_calls == 0  # the third call's graph was the first's
    for b, r, g in zip(before, ref, got):
        untouched = ~written.to(b.device)  # [slots, positions] over [slots, heads, pos, dim]
        assert torch.equal(g.transpose(1, 2)[untouched], b.transpose(1, 2)[untouched])
        keep = written.clone()
        keep[:, d.cache.scratch_pos] = False
        keep = keep.to(b.device)
        torch.testing.assert_close(g.transpose(1, 2)[keep], r.transpose(1, 2)[keep])


def test_shapes_past_the_buckets_run_eagerly(target):
    """An ingest longer than the largest q bucket (a prompt's, at admission) runs the eager
    function: the same results, nothing recorded."""
    d, cap = drafter(target, q_max=4)
    with torch.inference_mode():
        ref = call(d, head_forward, 2, 9, True, 40, seed=3)
        got = call(d, cap, 2, 9, True, 40, seed=3)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert cap.eager_calls == 1 and cap.captures == 0


def test_greedy_with_the_captured_head_equals_plain_and_drafts_as_the_eager_head(target):
    """Every bucket captured at warm-up; ragged batches (rows joining and leaving) drafting
    through the captured head emit exactly the target's greedy output and accept what the eager
    head's drafts accept (on CPU the same per request; a replay on CUDA may round otherwise:
    within 10% in all), the head never fell back to eager and nothing is recorded after warm-up:
    the generation replayed graphs (counted from after the warm-up, which replays none) and ran
    the eager head only for ingests longer than the buckets, at most one a prompt.
    (Output is exact whatever the head drafts: the acceptance is what shows a wrong head.)"""
    # its layer reads its cache
    engine = eagle_engine(target, random_head(11), slots=4, k=3, capture_kv_align=KV_ALIGN)
    d = engine.drafter
    assert isinstance(d, EagleDrafter)
    d.warm_up()
    cap = d.forward
    assert isinstance(cap, HeadCapture) and not cap.eager
    graphs = len(cap.graphs)
    rows, kv, q = len(cap.row_buckets), len(cap.kv_buckets), len(cap.q_buckets)
    assert graphs == cap.captures == rows * kv * (q + 1)  # ingest q buckets and the chain step
    g = SamplingParams(temperature=0, max_tokens=24)
    ps = prompts(6, seed=5)
    plain = helpers.engine_for(target, None, slots=4)
    refs = [plain.generate([p], g)[0].output_ids for p in ps]
    eager = eagle_engine(target, random_head(11), slots=4, k=3).generate(ps, g, SpecParams(k=3))
    calls, eager_calls = cap.calls, cap.eager_calls
    outs = engine.generate(ps, g, SpecParams(k=3))
    assert [s.output_ids for s in outs] == refs
    helpers.assert_speculated(outs)
    assert cap.calls > calls and cap.eager_calls - eager_calls <= len(ps)
    got, ref = [s.accepted for s in outs], [s.accepted for s in eager]
    if d.device.type == "cpu":
        assert got == ref
    else:
        assert abs(sum(got) - sum(ref)) <= 0.1 * sum(ref)
    assert sum(ref) > 0 and sum(ref) < sum(s.drafted for s in eager)  # some right, some wrong
    assert d.forward is cap and cap.captures == graphs
    assert engine.drafter_failures == 0 and d.cache.used_tokens() == 0


def test_draft_trees_replay_the_captured_target_and_head(target):
    """EAGLE-2 trees (top 4: chains of 2 and 6 more nodes) with the target and the head both
    captured: every tree verify replays a verify graph (a tree and a chain share them: the
    graph records its mask from static inputs), every tree step of the head (the chain rows and
    the extras, masked) replays a masked graph; all recorded at warm-up and never after. Greedy
    output equals plain decoding and the trees accept what the eager engine's trees accept (on
    CPU the same per request). Before the graphs took masks, a tree verify dropped the target's
    captured path for good and the head ran every tree step eagerly."""
    from engine.kcontrol.controller import FixedK
    from engine.model.compiled import CompileConfig
    from engine.model.cuda_graphs import GraphForward

    graphs = CompileConfig(enabled=True, mode="cuda-graphs", batch_buckets=[4], q_buckets=[1, 16])

    def tree_engine(compile=None, head_capture=None):
        return helpers.engine_for(
            target, "eagle3", 4, head=random_head(11), controller=FixedK(2, 6), tree_topk=4,
            compile=compile, head_capture=head_capture,
        )  # fmt: skip

    engine = tree_engine(graphs, head_capture=KV_ALIGN)
    d, fast = engine.drafter, engine.target.fast
    assert isinstance(d, EagleDrafter) and isinstance(fast, GraphForward)
    engine.warm_up()
    cap = d.forward
    assert isinstance(cap, HeadCapture) and not cap.eager and cap.masked_buckets[-1] == 4 * 4
    masked = [k for k in cap.graphs if k[4]]
    assert len(masked) == len(cap.masked_buckets) * len(cap.kv_buckets)
    head_graphs, target_graphs = cap.captures, fast.captures
    g = SamplingParams(temperature=0, max_tokens=24)
    ps = prompts(6, seed=5)
    plain = helpers.engine_for(target, None, slots=4)
    refs = [plain.generate([p], g)[0].output_ids for p in ps]
    eager = tree_engine().generate(ps, g, SpecParams(k=2))
    paths, eager_calls = helpers.Paths(engine.target), cap.eager_calls
    outs = engine.generate(ps, g, SpecParams(k=2))
    assert [s.output_ids for s in outs] == refs
    helpers.assert_speculated(outs)
    assert sum(s.tree_rounds for s in outs) > 0 and engine.drafter_failures == 0
    assert engine.target.fast is fast and fast.captures == target_graphs  # never dropped
    assert paths.fast > 0 and paths.eager == helpers.long_prompts(ps, 16)
    assert d.forward is cap and cap.captures == head_graphs
    assert cap.eager_calls - eager_calls <= len(ps)  # long ingests only: every tree step replayed
    got, ref = [s.accepted for s in outs], [s.accepted for s in eager]
    if d.device.type == "cpu":
        assert got == ref
    assert sum(ref) > 0
