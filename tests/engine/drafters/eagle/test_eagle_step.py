"""The EAGLE-3 head compiled without guards (engine/drafters/eagle/step.py) computes what the
eager head computes, for every key and for shapes other than those its graphs compiled with,
and an engine drafting with it keeps greedy output equal to the target's alone."""

from __future__ import annotations

import pytest
import torch

from engine.drafters.eagle.drafter import EagleDrafter
from engine.drafters.eagle.step import HeadGraphs, head_forward
from engine.records.params import SamplingParams, SpecParams
from tests import helpers
from tests.eagle_builders import (
    HIDDEN,
    LAYERS,
    VOCAB,
    assert_greedy_ragged_equals_plain,
    call,
    eagle_engine,
    prompts,
    random_head,
)


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)


@pytest.fixture(scope="module")
def compiled(target):
    """An engine whose head runs compiled (graphs warmed up), and its drafter."""
    engine = eagle_engine(target, random_head(5), slots=4, k=3, backend="inductor")
    d = engine.drafter
    assert isinstance(d, EagleDrafter)
    d.warm_up()
    return engine, d


def test_compiled_head_equals_eager_for_every_key_and_new_shapes(compiled):
    """One graph per key (rows and q each 1 or more; ingest or chain) serves shapes its compile
    never saw (other row counts, q, key lengths) with the eager head's results."""
    engine, d = compiled
    assert isinstance(d.forward, HeadGraphs)
    assert engine.forward_paths() == {"target": "eager", "head": "compiled"}
    keys = len(d.forward.graphs)
    assert keys == 6
    with torch.inference_mode():
        for t, seed in ((d.cache.k[0], 0), (d.cache.v[0], 1)):  # (generated on the host)
            g = torch.Generator().manual_seed(seed)
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
        for i, (rows, q, ingest, kv_len) in enumerate(
            [(1, 1, False, 7), (3, 1, False, 40), (1, 1, True, 19), (4, 5, True, 33),
             (2, 3, True, 100), (1, 6, True, 64), (4, 1, True, 2), (2, 1, False, 129)]
        ):  # fmt: skip
            ref = call(d, head_forward, rows, q, ingest, kv_len, seed=i)
            got = call(d, d.forward, rows, q, ingest, kv_len, seed=i)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(d.forward.graphs) == keys  # no new compile: the keys covered every shape


def test_greedy_with_the_compiled_head_equals_plain(compiled, target):
    """Ragged batches drafting through the compiled head emit exactly the target's greedy
    output, and the compiled head still drafts (some drafts accepted, no faults)."""
    engine, d = compiled
    assert_greedy_ragged_equals_plain(engine, target, seed=3)
    assert isinstance(d.forward, HeadGraphs)  # never fell back to eager


def test_a_failing_graph_falls_back_to_the_eager_head(target):
    """A compiled head whose graph raises drafts on eagerly from then on, output unchanged."""
    engine = eagle_engine(target, random_head(5), slots=2, k=2)
    d = engine.drafter
    assert isinstance(d, EagleDrafter)

    def broken(*args):
        raise RuntimeError("inductor failed")

    d.forward = broken  # type: ignore[assignment]
    g = SamplingParams(temperature=0, max_tokens=12)
    p = prompts(1, seed=4)[0]
    ref = helpers.engine_for(target, None, slots=1).generate([p], g)[0].output_ids
    out = engine.generate([p], g, SpecParams(k=2))[0]
    assert out.output_ids == ref and out.drafted > 0
    assert d.forward is head_forward and engine.drafter_failures == 0
    assert engine.forward_paths()["head"] == "eager"  # the fallback is visible
