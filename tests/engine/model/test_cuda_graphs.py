"""The captured fast path (engine/model/cuda_graphs.py, ``compile.mode: cuda-graphs``, the fast path
of every mode on CUDA): greedy output through the graphs equals target-only greedy through the
eager engine, every bucket is captured once at warm-up and never again, and a round syncs once.

On a machine without CUDA the recorder re-runs the forward on the graphs' static buffers: the
equality tests then check the buffer plumbing. ``SPECD_TEST_DEVICE=cuda`` runs them with real
graphs; the tests marked for CUDA run only there. Replays are counted per generation, and the
eager forwards beside them (test_fast_forward.py's ``Paths``): only prefills longer than the
largest q bucket may run eagerly."""

import pytest
import torch

from engine.model.compiled import CompileConfig
from engine.model.cuda_graphs import GraphForward, kv_buckets
from engine.model.fast_path import fast_mode
from engine.records.params import SamplingParams, SpecParams
from tests.helpers import (
    TEST_DEVICE,
    Paths,
    assert_speculated,
    cuda_syncs,
    engine_for,
    long_prompts,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24)
on_cuda = pytest.mark.skipif(TEST_DEVICE.type != "cuda", reason="needs SPECD_TEST_DEVICE=cuda")


def prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 64, (int(L),), generator=g).tolist() for L in (3, 17, 40, 9, 60)[:n]]


def graph_engine(models, drafter, mode="cuda-graphs", **cfg):
    compiled = CompileConfig(enabled=True, mode=mode, **cfg)
    # "layers": the target's first 2 layers
    e = engine_for(models, drafter, num_layers=2, compile=compiled)
    e.warm_up()
    return e


@pytest.mark.parametrize("drafter", ["layers", "ngram", None])
def test_captured_engine_equals_eager_target_greedy(models, drafter):
    """Singles and a ragged batch of 5 (slots 0-4: the 8-row bucket, 3 padding rows), at K = 4
    (q = 5, padded to the 9-token bucket) and plain; no capture after warm-up; every decode,
    verify and drafting step replayed a graph."""
    ps = prompts()
    ref = [s.output_ids for s in engine_for(models, None).generate(ps, GREEDY)]
    e = graph_engine(models, drafter, batch_buckets=[1, 2, 4, 8], q_buckets=[1, 2, 9])
    fast = [r.fast for r in e.runners()]
    assert all(isinstance(f, GraphForward) for f in fast)
    n = 4 * 3 * len(fast[0].kv_buckets)
    assert [f.captures for f in fast] == [n] * len(fast)  # every (batch, q, keys) bucket, once
    paths = [Paths(r) for r in e.runners()]
    spec = SpecParams(k=4)
    singles = [e.generate([p], GREEDY, spec)[0] for p in ps[:2]]
    assert [s.output_ids for s in singles] == ref[:2]
    seqs = e.generate(ps, GREEDY, spec)
    assert [s.output_ids for s in seqs] == ref
    assert [f.captures for f in fast] == [n] * len(fast)  # steady state: replays only
    if drafter is None:
        assert sum(s.drafted for s in singles + seqs) == 0
    else:
        assert_speculated(singles + seqs)
    long = long_prompts(ps[:2] + ps, 9)
    assert paths[0].fast > 0 and paths[0].eager == long
    for draft in paths[1:]:
        assert draft.fast > 0 and draft.eager <= long


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_captured_engine_equals_eager_when_sampling(models, drafter):
    """Seeded sampling through the graphs gives the eager engine's very tokens (the same
    arithmetic, the same draws), drafts accepted and rejected, every verify and drafting step
    replayed. (A greedy row on a repeating prompt rides along: the n-gram drafter's copies are
    rarely accepted at T = 0.8 on this near-uniform target, and greedy there accepts most.)"""
    ps = prompts() + [[1, 2, 3] * 3]
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=i) for i in range(5)]
    params.append(SamplingParams(temperature=0, max_tokens=16))
    spec = SpecParams(k=3)
    ref = [s.output_ids for s in engine_for(models, drafter).generate(ps, params, spec)]
    e = graph_engine(models, drafter, batch_buckets=[8], q_buckets=[1, 4])
    paths = [Paths(r) for r in e.runners()]
    seqs = e.generate(ps, params, spec)
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(seqs)
    assert paths[0].fast > 0 and paths[0].eager == long_prompts(ps, 4)
    for draft in paths[1:]:
        assert draft.fast > 0 and draft.eager <= long_prompts(ps, 4)


def test_fused_graphs_equal_eager_target_greedy(models):
    """``compile.fuse``: the captured forward runs inductor's layer groups (guards kept): a
    ragged batch at K = 4 and plain (decode steps padded to the one q bucket, 5) equals
    target-only greedy through the eager engine; one compiled graph (one key: batch 8, q 5),
    every key-length bucket captured once. (One key: each costs a compile.)"""
    ps = prompts()
    ref = [s.output_ids for s in engine_for(models, None).generate(ps, GREEDY)]
    e = graph_engine(models, "ngram", batch_buckets=[8], q_buckets=[5], fuse=True)
    fast = e.target.fast
    assert isinstance(fast, GraphForward) and fast.groups is not None
    assert len(fast.groups.graphs) == 1 and fast.captures == len(fast.kv_buckets)
    paths = Paths(e.target)
    seqs = e.generate(ps, GREEDY, SpecParams(k=4))
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(seqs)
    assert [s.output_ids for s in e.generate(ps, GREEDY, SpecParams(enabled=False))] == ref
    assert len(fast.groups.graphs) == 1 and fast.captures == len(fast.kv_buckets)
    assert paths.fast > 0 and paths.eager == 2 * long_prompts(ps, 5)


def test_a_failing_fused_group_captures_the_eager_stack(models, monkeypatch):
    """``compile.fuse`` whose compiled groups fail at warm-up: the eager stack is captured
    instead (graphs kept, output exact), not the whole fast path dropped."""
    from engine.model.group_graphs import GuardedGroups

    def broken(self):
        def fail(*args):
            raise RuntimeError("no inductor here")

        return fail

    monkeypatch.setattr(GuardedGroups, "_compile", broken)
    ps = prompts(3)
    ref = [s.output_ids for s in engine_for(models, None).generate(ps, GREEDY)]
    e = graph_engine(models, "ngram", batch_buckets=[8], q_buckets=[5], fuse=True)
    fast = e.target.fast
    assert isinstance(fast, GraphForward) and fast.groups is None
    assert fast.captures >= len(fast.kv_buckets)
    paths = Paths(e.target)
    seqs = e.generate(ps, GREEDY, SpecParams(k=4))
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(seqs)
    assert paths.fast > 0 and paths.eager == long_prompts(ps, 5)


def test_key_length_buckets():
    assert kv_buckets(64, 257) == [64, 128, 256, 257]
    assert kv_buckets(64, 64) == [64]
    assert kv_buckets(16, 40) == [16, 32, 40]


def test_a_failing_capture_falls_back_to_eager(models, monkeypatch):
    def broken(self, nb, qb, kv):
        raise RuntimeError("no graphs here")

    monkeypatch.setattr(GraphForward, "_capture", broken)
    ps = prompts(3)
    ref = [s.output_ids for s in engine_for(models, None).generate(ps, GREEDY)]
    e = graph_engine(models, "ngram", batch_buckets=[8], q_buckets=[1, 5])
    assert e.target.fast is None
    seqs = e.generate(ps, GREEDY, SpecParams(k=3))
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(seqs)


@on_cuda
def test_one_sync_per_round_through_graphs(models):  # pragma: no cover - GPU only
    e = graph_engine(models, "model", batch_buckets=[4, 8], q_buckets=[1, 4])
    params = SamplingParams(temperature=0.7, max_tokens=40)
    for i, p in enumerate(prompts(4)):
        e.add_request(f"r{i}", p, params, SpecParams(k=3))
    e.step()
    e.step()
    rounds = [cuda_syncs(e.step) for _ in range(5)]
    assert all(len(r) == 1 for r in rounds), rounds


def test_inductor_modes_run_as_captured_graphs_on_cuda():
    """On CUDA every inductor mode is served by captured graphs (engine/model/compiled.py
    ``fast_mode``: inductor's guardless graphs tripped a device-side assert there), of
    inductor's guarded groups (``fuse``); CPU keeps the mode it asks for, and so does the
    dynamo-only "eager" backend."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for mode in ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "cuda-graphs"):
        assert fast_mode(CompileConfig(enabled=True, mode=mode), cuda) == "cuda-graphs"
        assert fast_mode(CompileConfig(enabled=True, mode=mode), cpu) == mode
    assert fast_mode(CompileConfig(enabled=True, backend="eager"), cuda) == "default"


@on_cuda
def test_an_inductor_mode_on_cuda_captures_fused_groups(models):  # pragma: no cover - GPU only
    e = graph_engine(models, "ngram", mode="default", batch_buckets=[8], q_buckets=[5])
    assert isinstance(e.target.fast, GraphForward) and e.target.fast.groups is not None
