"""The EAGLE-3 head served by the runner that serves the target (engine/drafters/eagle/stack.py):
its fast path, compiled (CPU) or captured (CUDA graphs; on a machine without CUDA a replay
re-runs the forward on the static buffers, which tests the plumbing), computes what its eager
forward computes for ingests and chained steps, padded into buckets or not; an engine drafting
through it keeps greedy output equal to the target's alone, drafts what the eager head drafts,
and a failing graph leaves the head eager for good, output unchanged."""

from __future__ import annotations

import pytest
import torch

from engine.drafters.eagle.drafter import EagleDrafter
from engine.model.compiled import CompileConfig, FastForward
from engine.model.cuda_graphs import GraphForward
from engine.records.params import SamplingParams, SpecParams
from tests import helpers
from tests.eagle_builders import (
    HIDDEN,
    LAYERS,
    VOCAB,
    assert_greedy_ragged_equals_plain,
    eagle_engine,
    head_call,
    prompts,
    random_head,
)

COMPILED = CompileConfig(enabled=True, backend="inductor", kv_align=16)
CAPTURED = CompileConfig(enabled=True, mode="cuda-graphs", kv_align=16)
# (rows, q, ingest, key length): exact buckets, padded ones (3 -> 4 rows, q 3 -> 4, 5 -> 8), one
# past the largest q bucket (a prompt's ingest at admission: eager)
SHAPES = [(1, 1, False, 7), (3, 1, False, 40), (1, 1, True, 19), (4, 5, True, 33),
          (2, 3, True, 100), (1, 6, True, 64), (4, 1, True, 2), (2, 1, False, 129),
          (2, 40, True, 60)]  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)


def warmed(target, compile: CompileConfig, head_seed: int = 5) -> tuple:
    """An engine whose head's runner has ``compile``'s fast path, warmed up; and its drafter."""
    engine = eagle_engine(target, random_head(head_seed), slots=4, k=3, compile=compile)
    d = engine.drafter
    assert isinstance(d, EagleDrafter)
    d.warm_up()
    return engine, d


def randomize(d: EagleDrafter) -> None:
    with torch.inference_mode():
        for t, seed in ((d.cache.k[0], 0), (d.cache.v[0], 1)):  # (generated on the host)
            g = torch.Generator().manual_seed(seed)
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))


@pytest.mark.parametrize("compile", [COMPILED, CAPTURED], ids=["compiled", "captured"])
def test_the_heads_fast_path_computes_its_eager_forward(target, compile):
    """Ingests and chained steps of many shapes (rows of ragged lengths) through the fast path
    give the eager forward's outputs, logits and written K; every call in the buckets took the
    fast path (its call count grows by one each; compiled, the graphs of the whole stack, adapter
    and output included), the one past them ran eagerly, and nothing compiled or recorded after
    the warm-up."""
    engine, d = warmed(target, compile)
    fast = d.head_runner.fast
    assert isinstance(fast, GraphForward if compile is CAPTURED else FastForward)
    assert type(fast) is (GraphForward if compile is CAPTURED else FastForward)
    kind = "cuda-graphs" if compile is CAPTURED else "compiled"
    assert engine.forward_paths() == {"target": "eager", "head": kind}
    made = graphs_made(fast)
    randomize(d)
    with torch.inference_mode():
        for i, (rows, q, ingest, kv_len) in enumerate(SHAPES):
            with d.head_runner.eager():
                ref = head_call(d, rows, q, ingest, kv_len, seed=i)
            calls = fast.calls
            got = head_call(d, rows, q, ingest, kv_len, seed=i)
            assert fast.calls == calls + (q <= fast.q_buckets[-1])
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert graphs_made(fast) == made  # the warm-up covered every shape
    assert d.head_runner.fast is fast  # never dropped
    if not isinstance(fast, GraphForward):  # every call took the whole stack's graph
        assert fast.whole is not None and fast.whole.graphs and not fast.graphs.graphs


def graphs_made(fast: FastForward) -> int:
    if isinstance(fast, GraphForward):
        return len(fast.captured)
    return len(fast.graphs.graphs) + (len(fast.whole.graphs) if fast.whole else 0)


@pytest.mark.parametrize("compile", [COMPILED, CAPTURED], ids=["compiled", "captured"])
def test_greedy_through_the_heads_fast_path_equals_plain_and_drafts_as_eager(target, compile):
    """Ragged batches (rows joining and leaving) drafting through the head's fast path emit
    exactly the target's greedy output, the fast path served the head's calls and stayed, and
    the head accepted what the eager head's drafts accept (on CPU the same per request; a
    replay on CUDA may round otherwise: within 10% in all). (Output is exact whatever the head
    drafts: the acceptance is what shows a wrong head.)"""
    engine, d = warmed(target, compile, head_seed=11)
    fast = d.head_runner.fast
    assert fast is not None
    g = SamplingParams(temperature=0, max_tokens=24)
    ps = prompts(6, seed=5)
    plain = helpers.engine_for(target, None, slots=4)
    refs = [plain.generate([p], g)[0].output_ids for p in ps]
    eager = eagle_engine(target, random_head(11), slots=4, k=3).generate(ps, g, SpecParams(k=3))
    calls = fast.calls
    outs = engine.generate(ps, g, SpecParams(k=3))
    assert [s.output_ids for s in outs] == refs
    helpers.assert_speculated(outs)
    assert fast.calls > calls + sum(s.drafted for s in outs) // 3  # every chained step at least
    got, ref = [s.accepted for s in outs], [s.accepted for s in eager]
    if d.device.type == "cpu":
        assert got == ref
    else:
        assert abs(sum(got) - sum(ref)) <= 0.1 * sum(ref)
    assert sum(ref) > 0 and sum(ref) < sum(s.drafted for s in eager)  # some right, some wrong
    assert d.head_runner.fast is fast and engine.drafter_failures == 0
    assert d.cache.used_tokens() == 0


def test_greedy_with_the_compiled_head_and_target_equals_plain(target):
    """Both runners compiled, as the shipped config builds them: exact greedy output."""
    engine = helpers.engine_for(target, "eagle3", 4, head=random_head(5), compile=COMPILED, k_max=3)
    assert engine.forward_paths() == {"target": "compiled", "head": "compiled"}
    assert_greedy_ragged_equals_plain(engine, target, seed=3)


def test_a_failing_graph_leaves_the_head_eager(target):
    """A head whose compiled graph raises drafts on eagerly from then on, output unchanged, and
    the fallback shows in the forward paths."""
    engine = eagle_engine(target, random_head(5), slots=2, k=2, compile=COMPILED)
    d = engine.drafter
    assert isinstance(d, EagleDrafter)
    fast = d.head_runner.fast
    assert isinstance(fast, FastForward)

    def broken(*args):
        raise RuntimeError("inductor failed")

    fast.graphs = fast.whole = broken  # type: ignore[assignment]
    g = SamplingParams(temperature=0, max_tokens=12)
    p = prompts(1, seed=4)[0]
    ref = helpers.engine_for(target, None, slots=1).generate([p], g)[0].output_ids
    out = engine.generate([p], g, SpecParams(k=2))[0]
    assert out.output_ids == ref and out.drafted > 0
    assert d.head_runner.fast is None and engine.drafter_failures == 0
    assert engine.forward_paths()["head"] == "eager"


def test_draft_trees_with_the_captured_target_and_head(target):
    """EAGLE-2 trees (top 4: chains of 2 and 6 more nodes) with the target and the head both
    captured: every tree verify replays a verify graph (a tree and a chain share them), the
    head's chained steps and ingests replay its graphs (a tree step, whose rows share slots,
    runs its eager forward), nothing is recorded after warm-up; greedy output equals plain
    decoding and the trees accept what the eager engine's trees accept (on CPU the same per
    request)."""
    from engine.kcontrol.controller import FixedK

    graphs = CompileConfig(enabled=True, mode="cuda-graphs", batch_buckets=[4], q_buckets=[1, 16])

    def tree_engine(compile=None):
        return helpers.engine_for(
            target, "eagle3", 4, head=random_head(11), controller=FixedK(2, 6), tree_topk=4,
            compile=compile,
        )  # fmt: skip

    engine = tree_engine(graphs)
    d, fast = engine.drafter, engine.target.fast
    assert isinstance(d, EagleDrafter) and isinstance(fast, GraphForward)
    engine.warm_up()
    head_fast = d.head_runner.fast
    assert isinstance(head_fast, GraphForward)
    head_graphs, target_graphs = head_fast.captures, fast.captures
    g = SamplingParams(temperature=0, max_tokens=24)
    ps = prompts(6, seed=5)
    plain = helpers.engine_for(target, None, slots=4)
    refs = [plain.generate([p], g)[0].output_ids for p in ps]
    eager = tree_engine().generate(ps, g, SpecParams(k=2))
    paths, head_calls = helpers.Paths(engine.target), head_fast.calls
    outs = engine.generate(ps, g, SpecParams(k=2))
    assert [s.output_ids for s in outs] == refs
    helpers.assert_speculated(outs)
    assert sum(s.tree_rounds for s in outs) > 0 and engine.drafter_failures == 0
    assert engine.target.fast is fast and fast.captures == target_graphs  # never dropped
    assert paths.fast > 0 and paths.eager == helpers.long_prompts(ps, 16)
    assert d.head_runner.fast is head_fast and head_fast.captures == head_graphs
    assert head_fast.calls > head_calls
    got, ref = [s.accepted for s in outs], [s.accepted for s in eager]
    if d.device.type == "cpu":
        assert got == ref
    assert sum(ref) > 0
