"""A draft tree verified in one target forward (engine/model/tree_attention.py): every node's
logits equal a plain forward of the path to it (fp32), eager, through the compiled path (the
graphs take the tree's mask as they take the causal one) and through the captured graphs (a
verify's graph records its mask from static inputs: a tree replays a chain's graph), in a batch
with a chain row and a row in a far slot; and after the accepted path's K/V are moved into a
chain (SlotKVCache.move) the cache decodes on as if that path had been fed as a chain."""

import pytest
import torch

from engine.model.compiled import CompileConfig
from engine.model.runner import ModelRunner
from engine.model.tree_attention import Tree
from engine.round.tree import ancestors, depths
from tests.helpers import tiny_llama

PARENTS = [-1, -1, 0, 0, 1, 1]  # two candidates at the root, two below each
TOKENS = [5, 9, 11, 3, 7, 9]


def runner(path: str) -> ModelRunner:
    """``path``: eager, compiled (the CPU fast path) or captured (CUDA graphs; without CUDA a
    replay re-runs the recorded forward on the graph's static inputs)."""
    mode = "cuda-graphs" if path == "captured" else "default"
    cfg = CompileConfig(
        enabled=True, mode=mode, backend="eager", batch_buckets=[4, 8], q_buckets=[1, 8]
    )
    compile = None if path == "eager" else cfg
    return ModelRunner(tiny_llama(4, layers=2), 8, 64, compile=compile, k_max=7)


def tree_of(parents: list[int], q: int) -> Tree:
    """The Tree of one row: the root (query 0) and nodes 1.., padded to ``q`` queries."""
    n = len(parents)
    par = torch.tensor([parents])
    depth = torch.zeros(1, q, dtype=torch.long)
    depth[0, 1 : n + 1] = depths(par)[0]
    visible = torch.eye(q, dtype=torch.bool)[None].clone()
    visible[0, 1 : n + 1, 0] = True  # every node sees the root
    visible[0, 1 : n + 1, 1 : n + 1] = ancestors(par)[0]
    return Tree(depth, visible)


def path_to(i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = PARENTS[i]
    return out[::-1]


def prefill(r: ModelRunner, slot: int, prompt: list[int]) -> None:
    r.cache.allocate(slot)
    r.forward([prompt], [slot])
    r.cache.commit(slot, len(prompt))


@pytest.mark.parametrize("path", ["eager", "compiled", "captured"])
def test_each_node_sees_its_path_and_the_accepted_path_decodes_on(path):
    r = runner(path)
    prompt, root = [1, 2, 3, 4, 6], 8
    # slot 0: the tree; slot 1: a chain row of 3 tokens; slot 5 (far: a span of padding rows)
    # the same tree again
    for s in (0, 1, 5):
        prefill(r, s, prompt)
    q = 8
    ids = torch.tensor([[root, *TOKENS, 0], [root, 2, 4, 0, 0, 0, 0, 0], [root, *TOKENS, 0]])
    one = tree_of(PARENTS, q)
    chain = tree_of([-1, 0], q)
    tree = Tree(
        torch.cat([one.depth, chain.depth, one.depth]),
        torch.cat([one.visible, chain.visible, one.visible]),
    )
    calls = r.fast.calls if r.fast is not None else 0
    logits = r.forward(ids, [0, 1, 5], [7, 3, 7], "all", tree=tree).logits  # [3, q, vocab]
    if path != "eager":
        assert r.fast is not None and r.fast.calls == calls + 1  # the fast path ran it
    with r.eager():  # references: plain forwards of each path in fresh slots
        for i in range(len(TOKENS)):
            path = [TOKENS[j] for j in path_to(i)]
            prefill(r, 7, prompt)
            want = r.forward([[root, *path]], [7]).logits[0]
            r.cache.free(7)
            for row in (0, 2):
                torch.testing.assert_close(logits[row, i + 1], want, rtol=1e-5, atol=1e-5)
        prefill(r, 7, prompt)
        want_chain = r.forward([[root, 2, 4]], [7], logits="all").logits[0]
        r.cache.free(7)
    torch.testing.assert_close(logits[1, :3], want_chain, rtol=1e-5, atol=1e-5)
    # accept nodes 1 and 5 (tokens 9, 9): their K/V move to the chain's columns, then decode on
    start = len(prompt)
    src = torch.tensor([[start + 2, start + 6]])  # columns of nodes 1 and 5
    dst = torch.tensor([[start + 1, start + 2]])
    r.cache.move(torch.tensor([0]), src, dst)
    r.cache.commit(0, start + 3)  # root, 9, 9
    got = r.forward([[4]], [0]).logits[0]
    with r.eager():
        prefill(r, 7, prompt + [root, 9, 9])
        want = r.forward([[4]], [7]).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
