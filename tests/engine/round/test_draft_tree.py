"""A round's draft trees (engine/round/draft_tree.py): the chain plus the best runners-up as
leaves, and the accepted path laid out as a chain again, the target's K/V moved with it."""

import torch

from engine.drafters.base import Alternatives
from engine.kv.kv_cache import SlotKVCache
from engine.round.draft_tree import grow, settle

NEG = float("-inf")


def two_rows():
    """Row 0 drafted 2 of K = 3 and may take 2 leaves; row 1 drafted 3 and is a chain."""
    drafts = torch.tensor([[10, 11, 0], [20, 21, 22]])
    alts = Alternatives(
        torch.tensor([[[12, 13], [14, 15], [16, 17]], [[23, 24], [25, 26], [27, 28]]]),
        # row 0: position 1's first runner-up is worth most, then position 0's first; its
        # position 2 was not drafted (its runners-up must not be kept, whatever their worth)
        torch.tensor([[[0.3, 0.1], [0.4, 0.05], [0.9, 0.8]], [[0.5, 0.4], [0.3, 0.2], [0.1, NEG]]]),
    )
    q = torch.rand(2, 3, 30)
    return drafts, q, alts


def test_grow_hangs_the_best_runners_up_on_the_chain():
    drafts, q, alts = two_rows()
    t = grow(drafts, [2, 3], q, alts, [2, 0])
    assert t.tokens[0].tolist() == [10, 11, 0, 12, 14]  # the chain, then the best two by id
    assert t.parents[0].tolist() == [-1, 0, 1, -1, 0]  # a runner-up of d_{j+1} hangs on d_j
    assert t.valid[0].tolist() == [True, True, False, True, True]
    assert t.valid[1].tolist() == [True, True, True, False, False]  # a chain: no leaves
    assert t.tree.depth[0].tolist() == [0, 1, 2, 3, 1, 2]  # the root, then each node's depth
    vis = t.tree.visible[0]
    assert vis[4].tolist() == [True, False, False, False, True, False]  # node 3: root, itself
    assert vis[5].tolist() == [True, True, False, False, False, True]  # node 4: root, d_1, itself
    # q: the root's and each chain node's children were drawn from q of the next position;
    # leaves and the chain's last node have no children
    assert torch.equal(t.q[:, :3], q) and not t.q[:, 3:].any()
    assert t.width == 3 and t.chain == 3


def test_settle_lays_the_path_out_as_a_chain_and_moves_its_kv():
    drafts, q, alts = two_rows()
    t = grow(drafts, [2, 3], q, alts, [2, 0])
    cache = SlotKVCache(2, 3, 1, 2, 32, torch.float32, "cpu")
    for layer in cache.k + cache.v:
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).view_as(layer))
    before = [layer.clone() for layer in cache.k + cache.v]
    slots, starts = [2, 0], [5, 9]
    # row 0: d_1 (node 0), then the leaf on it (node 3); row 1: d_1 d_2 of its chain
    path = torch.tensor([[0, 4, -1], [0, 1, -1]])
    num_acc = torch.tensor([2, 2])
    probs = torch.rand(2, 6, 30)
    tapped = torch.rand(2, 6, 4)
    st = settle(t, path, num_acc, probs, tapped, cache, slots, starts)
    assert st.drafts[0, :2].tolist() == [10, 14] and st.drafts[1, :2].tolist() == [20, 21]
    assert torch.equal(st.probs[0], probs[0, [0, 1, 5, 3]])  # past the path: the chain's own
    assert torch.equal(st.tapped[1], tapped[1, [0, 1, 2, 3]])
    assert st.tree_stats.tolist() == [[2, 1], [0, 0]]  # leaves verified, path ended at one
    for now, was in zip(cache.k + cache.v, before):
        # row 0: the leaf's K/V (written at start + 1 + 4) now at the path's second position
        assert torch.equal(now[2, :, 7], was[2, :, 10])
        assert torch.equal(now[2, :, 6], was[2, :, 6])
        assert torch.equal(now[0], was[0])  # a chain's path is where the verify wrote it
        assert torch.equal(now[1], was[1])  # another slot untouched


def test_grow_keeps_the_most_worth_of_deeper_nodes_with_their_ancestors():
    """EAGLE-2's expansion adds nodes below the runners-up (Alternatives.more, parents in the
    Alternatives' id space): the row's best ``extra`` by worth, ties to the earlier id, are kept
    in id order, each hung on its parent's new place; a node past the cut leaves its children
    out. Point rows pass through (their candidates were chosen: tree.py)."""
    drafts = torch.tensor([[10, 11]])
    alts = Alternatives(
        torch.tensor([[[12, 13], [14, 15]]]),  # ids 2, 3 (on the root), 4, 5 (on d_1)
        torch.tensor([[[0.3, 0.1], [0.2, 0.05]]]),
        # ids 6, 7, 8: 16 below 12, 17 below 13, 18 below 16
        (
            torch.tensor([[16, 17, 18]]),
            torch.tensor([[0.25, 0.02, 0.2]]),
            torch.tensor([[2, 3, 6]]),
        ),
        3,
        torch.tensor([True]),
    )
    t = grow(drafts, [2], None, alts, [4])
    assert t.tokens[0].tolist() == [10, 11, 12, 14, 16, 18]  # 0.3, 0.2 (id 4), 0.25, 0.2 (id 8)
    assert t.parents[0].tolist() == [-1, 0, -1, 0, 2, 4]
    assert t.tree.depth[0].tolist() == [0, 1, 2, 1, 2, 2, 3]
    assert t.valid.all() and t.point.tolist() == [True] and t.width == 3
    t = grow(drafts, [2], None, alts, [3])  # 18 is cut: 12, 14, 16
    assert t.tokens[0].tolist() == [10, 11, 12, 14, 16]
    assert t.parents[0].tolist() == [-1, 0, -1, 0, 2]
