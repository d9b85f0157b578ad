"""The fast forward path (engine/model/compiled.py): bucketing, padding rows that never touch a
committed position, exact output through the compiled path (dynamo-only "eager" backend for the
shape logic, inductor for the real thing), warm-up before ready, and the eager fallback.

"The fast path ran" is counted per generation (:class:`Paths`): the fast path's calls after its
warm-up (which runs every bucket, so a total proves nothing) and the eager forwards beside them.
The draft model that speculates is the target's first two layers ("layers"): the conftest's
one-layer draft model never agrees with the target at greedy (no draft accepted), so with it a
comparison would never exercise an accepted draft."""

import logging

import pytest
import torch

from engine.model.compiled import CompileConfig, FastForward, bucket, default_buckets
from engine.records.params import SamplingParams, SpecParams
from engine.worker.worker import EngineWorker, NotAcceptingError
from tests.helpers import Paths, assert_speculated, engine_for, long_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (int(L),), generator=g).tolist() for L in (3, 17, 40, 9, 60)[:n]]


def compiled_engine(models, drafter="layers", **cfg):
    # "layers": the target's first 2 layers
    return engine_for(models, drafter, num_layers=2, compile=CompileConfig(enabled=True, **cfg))


def test_buckets():
    assert default_buckets(16) == [1, 2, 4, 8, 16]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(2, 9) == [1, 2, 9]
    assert bucket([1, 2, 4, 9], 3) == 4 and bucket([1, 2, 4, 9], 9) == 9
    assert bucket([1, 2, 4, 9], 10) is None


def test_handles_only_shapes_inside_the_buckets(models):
    e = engine_for(models, None)
    f = FastForward(
        e.target,
        CompileConfig(enabled=True, backend="eager", batch_buckets=[2, 4], q_buckets=[1, 3]),
        k_max=2,
    )

    def handles(slots, q):  # rows are slots: a forward runs slots [0, max + 1)
        return f.bucket_shape(max(slots) + 1, q) is not None

    assert handles([0, 3], 3) and handles([1], 1)
    assert f.bucket_shape(4, 3) == (4, 3) and f.bucket_shape(2, 1) == (2, 1)
    assert not handles([4], 1)  # slot 4 is past the largest batch bucket (rows are slots)
    assert not handles([0], 4)  # q past the largest q bucket: eager
    # buckets past the cache's 8 slots are cut to it (a config's 16 under --max-running 8)
    assert FastForward(e.target, CompileConfig(batch_buckets=[4, 16]), 2).batch_buckets == [4, 8]
    assert FastForward(e.target, CompileConfig(batch_buckets=[2, 8]), 2).batch_buckets == [2, 8]


def test_padded_shape_is_the_bucket_the_forward_runs(models):
    assert engine_for(models, "ngram").target.padded_shape(3, 2) == (3, 2)  # eager: as given
    compiled = CompileConfig(enabled=True, backend="eager", batch_buckets=[2, 4], q_buckets=[1, 4])
    e = engine_for(models, "ngram", compile=compiled)
    assert e.target.padded_shape(1, 1) == (2, 1)
    assert e.target.padded_shape(3, 2) == (4, 4)
    assert e.target.padded_shape(3, 5) == (3, 5)  # past the q buckets: eager, unpadded
    assert e.controller.cost.shape == e.target.padded_shape  # the adaptive K prices it


@pytest.mark.parametrize("drafter", ["layers", "ngram", None])
def test_fast_path_output_equals_eager(models, drafter):
    """Dynamo traces the layer (backend "eager": no inductor, fast); every bucket and a batch
    whose slots are not contiguous go through it; greedy output at K = 3 equals target-only
    greedy through the eager engine. Every decode / verify / draft step ran compiled: the only
    eager forwards are prefills longer than the largest q bucket (9)."""
    ps = prompts()
    ref = [s.output_ids for s in engine_for(models, None).generate(ps, GREEDY)]
    e = compiled_engine(
        models, drafter, backend="eager", batch_buckets=[1, 2, 4, 8], q_buckets=[1, 2, 4, 9]
    )
    e.warm_up()
    paths = [Paths(r) for r in e.runners()]
    seqs = e.generate(ps, GREEDY, SpecParams(k=3))
    assert [s.output_ids for s in seqs] == ref
    if drafter is None:
        assert sum(s.drafted for s in seqs) == 0
    else:
        assert_speculated(seqs)
    target = paths[0]
    assert target.fast > 0 and target.eager == long_prompts(ps, 9)  # the 17, 40, 60 prompts
    for draft in paths[1:]:  # the draft model's own runner: drafting steps compiled too
        assert draft.fast > 0 and draft.eager <= long_prompts(ps, 9)


def test_padding_rows_never_touch_committed_positions(models):
    e = compiled_engine(models, None, backend="eager", batch_buckets=[8], q_buckets=[4])
    r, cache = e.target, e.target.cache
    for s, n in ((0, 10), (3, 7), (6, 12)):  # committed prefixes in slots 0, 3, 6
        cache.allocate(s)
        r.forward([list(range(1, n + 1))], [s])  # prefill (eager: longer than the q bucket)
        cache.commit(s, n)
    before_k, before_v = torch.stack(cache.k), torch.stack(cache.v)
    assert r.fast.calls == 0  # the prefills ran eagerly (no warm-up here)
    r.forward(torch.tensor([[5, 6, 7]], device=r.device), [3], counts=[2])  # 2 valid of 3
    assert r.fast.calls == 1
    changed = (torch.stack(cache.k) != before_k).any(-1)  # [layers, slots, kv_heads, positions]
    changed |= (torch.stack(cache.v) != before_v).any(-1)
    where = changed.nonzero()[:, [1, 3]].unique(dim=0).tolist()  # (slot, position) pairs
    scratch = cache.scratch_pos
    assert [3, 7] in where and [3, 8] in where  # the row's own two new positions
    for slot, p in where:
        assert p == scratch or (slot == 3 and p in (7, 8)), (slot, p)
    for s, n in ((0, 10), (6, 12)):  # other rows' committed positions are untouched
        assert torch.equal(torch.stack(cache.k)[:, s, :, :n], before_k[:, s, :, :n])


def test_inductor_compiled_engine_is_exact(models):
    """The real compile (inductor, fp32): speculative greedy through the compiled path equals
    target-only greedy through the eager path, at batch 1 and 5, with a draft model; its
    verifies and drafting steps ran compiled."""
    ps = prompts()
    plain = engine_for(models, None)
    ref = [s.output_ids for s in plain.generate(ps, GREEDY)]
    e = compiled_engine(models, "layers", batch_buckets=[1, 8], q_buckets=[1, 9])
    e.warm_up()
    assert all(r.fast is not None for r in e.runners()), "inductor compile fell back to eager"
    paths = [Paths(r) for r in e.runners()]
    spec = SpecParams(k=3)
    singles = [e.generate([p], GREEDY, spec)[0] for p in ps[:2]]
    assert [s.output_ids for s in singles] == ref[:2]
    seqs = e.generate(ps, GREEDY, spec)
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(singles + seqs)
    target, draft = paths
    assert target.fast > 0 and target.eager == long_prompts(ps[:2] + ps, 9)
    assert draft.fast > 0 and draft.eager <= long_prompts(ps[:2] + ps, 9)


def test_compile_failure_falls_back_to_eager(models, caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    ps = prompts(3)
    spec = SpecParams(k=3)
    ref = [s.output_ids for s in engine_for(models, None).generate(ps, GREEDY)]
    e = compiled_engine(models, "ngram", backend=broken, batch_buckets=[8], q_buckets=[9])
    assert e.forward_paths() == {"target": "compiled"}  # built, not yet compiled
    with caplog.at_level(logging.WARNING):
        e.warm_up()
    assert e.target.fast is None
    assert "running eagerly" in caplog.text
    # the fallback is visible: the forward-path gauge's source and the start-up log line
    assert e.forward_paths() == {"target": "eager"}
    assert "forward paths after warm-up: target eager" in caplog.text
    seqs = e.generate(ps, GREEDY, spec)
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(seqs)
    # the same at serving time, without a warm-up: the first fast call fails, eager takes over
    e = compiled_engine(models, "ngram", backend=broken, batch_buckets=[8], q_buckets=[9])
    seqs = e.generate(ps, GREEDY, spec)
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(seqs)
    assert e.target.fast is None and e.forward_paths() == {"target": "eager"}


def test_worker_is_not_ready_until_warmed_up(models):
    e = compiled_engine(models, None, backend="eager", batch_buckets=[8], q_buckets=[1])
    calls = []
    real = e.warm_up

    def slow_warm_up():
        with pytest.raises(NotAcceptingError):
            w.reserve(1)  # still warming: refused (HTTP 503)
        calls.append(1)
        real()

    e.warm_up = slow_warm_up
    w = EngineWorker(e)
    assert not w.warmed.is_set()
    w.start()
    try:
        assert w.warmed.wait(60)
        assert calls == [1]
        w.reserve(1).release()
    finally:
        w.shutdown()
    # an engine without a fast path is ready at once
    w2 = EngineWorker(engine_for(models, None))
    w2.start()
    try:
        assert w2.warmed.is_set()
    finally:
        w2.shutdown()
