"""Compiled layer groups picked by key without Dynamo's guards (engine/model/group_graphs.py): one
graph per key serves every group, shape and key length of its class; a structurally different
group gets a graph of its own; outputs, cache writes and EAGLE taps equal the eager stack."""

import torch

from engine.model.compiled import CompileConfig, FastForward
from engine.model.group_graphs import compile_guardless, own_code
from engine.model.runner import ModelRunner
from engine.model.weights import ModelWeights, dense_weights


def runner_pair(tiny_llama, taps=(), weights=None, **cfg):
    """Two runners of one model: eager, and compiled (Dynamo's "eager" backend: the graph logic
    without inductor's compile time) over groups of ``layers_per_graph`` layers."""
    eager = ModelRunner(tiny_llama, num_slots=4, max_len=64, taps=taps, weights=weights)
    ccfg = CompileConfig(enabled=True, backend="eager", batch_buckets=[1, 4], **cfg)
    fast = ModelRunner(
        tiny_llama, num_slots=4, max_len=64, taps=taps, weights=weights, compile=ccfg, k_max=3
    )
    assert isinstance(fast.fast, FastForward)
    return eager, fast


def feed(runners, tokens, slots):
    """The same forward on each runner (committed after); returns each one's logits and tapped
    inputs."""
    outs = []
    for r in runners:
        outs.append(r.forward(tokens, slots, logits="all"))
        for s, t in zip(slots, tokens):
            r.cache.commit(s, r.cache.lengths[s] + len(t))
    return outs


def test_one_graph_per_key_serves_every_group_and_length(tiny_llama):
    eager, fast = runner_pair(tiny_llama, taps=(0, 2), layers_per_graph=1, q_buckets=[1, 4])
    for r in (eager, fast):
        for _ in range(4):
            r.cache.allocate()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    feed([eager, fast], [p[:4] for p in prompts], [0, 1, 2, 3])  # q 4: batch 4, q > 1
    # rows are slots: slot 0 alone runs batch 1, any other slot the batch-4 bucket
    assert fast.fast.calls == 1  # that forward ran compiled (none ran before it)
    steps = [([[7]], [0]), ([[8], [9]], [0, 2]), ([[3, 4]], [1]), ([[5, 6]], [0])] * 20
    fed = 1
    for tokens, slots in steps:  # keys: batch 1 or more x q 1 or more; lengths grow to ~64
        if max(fast.cache.lengths[s] for s in slots) + 2 >= fast.max_len:
            break
        e, f = feed([eager, fast], tokens, slots)
        fed += 1
        torch.testing.assert_close(f.logits, e.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(f.tapped, e.tapped, atol=1e-4, rtol=1e-4)
    assert fed > 20 and fast.fast.calls == fed  # every forward ran the compiled groups
    graphs = fast.fast.graphs.graphs
    assert len(graphs) == 4  # three layers share each key's graph, whatever the key length
    assert {k[0] for k in graphs} == {(True, True), (False, True), (True, False), (False, False)}
    for k_e, k_f in zip(eager.cache.k + eager.cache.v, fast.cache.k + fast.cache.v):
        for s in range(4):
            n = eager.cache.lengths[s]
            torch.testing.assert_close(k_f[s, :, :n], k_e[s, :, :n], atol=1e-4, rtol=1e-4)


def test_a_structurally_different_group_gets_its_own_graph(tiny_llama):
    """A layer whose weights differ in structure (here a Q bias, as a layer whose 4-bit
    conversion failed keeps dense weights) must not run another group's graph: guards that
    would have told them apart are dropped, so the key does."""
    layers = dense_weights(tiny_llama).layers
    bias = torch.randn(layers[1].q.shape[0]) * 0.5  # type: ignore[union-attr]
    layers[1] = layers[1]._replace(q_bias=bias)
    weights = ModelWeights(layers, None)
    eager, fast = runner_pair(tiny_llama, weights=weights, layers_per_graph=1, q_buckets=[1])
    for r in (eager, fast):
        r.cache.allocate()
    e, f = feed([eager, fast], [[11]], [0])
    torch.testing.assert_close(f.logits, e.logits, atol=1e-4, rtol=1e-4)
    assert len(fast.fast.graphs.graphs) == 2  # layers 0 and 2 share one, layer 1 its own
    e, f = feed([eager, fast], [[12]], [0])
    torch.testing.assert_close(f.logits, e.logits, atol=1e-4, rtol=1e-4)
    assert len(fast.fast.graphs.graphs) == 2
    assert fast.fast.calls == 2  # both forwards ran compiled


def test_guardless_graphs_of_one_function_keep_their_entries_apart():
    """Dynamo keeps compiled entries on the code object; without guards, a second compile of
    the same function runs the first's graph (shown by the control), so compile_guardless
    compiles a copy with a code object of its own (torch 2.11 has no isolate_recompiles)."""

    def scaled(x):
        return x * x.shape[0]  # static shapes: the length is a constant of the graph

    a, b = torch.arange(8.0), torch.arange(12.0)
    skip = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    shared = [torch.compile(scaled, backend="eager", options=skip, dynamic=False) for _ in "ab"]
    assert torch.equal(shared[0](a), a * 8)
    assert torch.equal(shared[1](b), b * 8)  # the control: the first graph's constant
    own = [compile_guardless(scaled, "eager") for _ in "ab"]
    assert torch.equal(own[0](a), a * 8) and torch.equal(own[1](b), b * 12)
    assert own_code(scaled).__code__ is not scaled.__code__
    assert own_code(scaled)(a).equal(scaled(a))
