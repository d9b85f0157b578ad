"""A round's draft trees: the drafted chain plus the drafter's best other candidates, verified in
one target forward and accepted by the tree rule (tree.py), then laid out as a chain again.

Shape (terms as in tree.py): a row's nodes are its chain d_1..d_K (nodes 0..K-1, each the child
of the one before) followed by ``extra`` more nodes (nodes K..K+extra-1), the row's ``extra``
candidates most worth (their estimated chance of being accepted) among:
  * runners-up (drafters/base.py ``Alternatives``): a runner-up of d_{j+1} is a child of d_j, the
    root's for j = 0, tried after d_{j+1}; within a position worth decreases in the order drawn,
    so the kept runners-up of a position are a prefix of that order, as the rule needs;
  * deeper nodes (``Alternatives.more``, EAGLE-2's expansion: drafters/eagle/expand.py): children
    of runners-up and of each other, never worth more than their parent.
Kept nodes are laid out in id order (parents first); ties go to the earlier id, so a kept node's
ancestors are kept. A row with ``extra`` = 0 is a plain chain in the same forward: a batch mixes
trees and chains.

Why around the chain: the head drafts the chain in K sequential steps either way; its runners-up
come from the logits it already computed, and the expansion's nodes from the same K calls (more
rows each), so the verify's extra queries are most of a tree's price, and the controller weighs
them (kcontrol/controller.py).

After acceptance (:func:`settle`), the accepted path is rewritten as the chain the rest of the
round expects (row b emits ``drafts[b, :accepted]`` and the next token; ``probs[b, i]`` is the
target's distribution at the i-th emitted position): the tokens and target probabilities are
gathered along the path, the target's K/V of the path's nodes are moved to the positions a chain
would have written (``SlotKVCache.move``), and the tapped features are gathered for the drafter's
``observe``, so the caches hold exactly what a chain accepting the same tokens leaves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.drafters.base import Alternatives
from engine.kv.paged_kv import KVCache
from engine.model.tree_attention import Tree
from engine.round.tree import ancestors
from engine.transfer import to_device


class DraftTree(NamedTuple):
    tokens: torch.Tensor  # [batch, n] long: node i's token (chain first, then the leaves)
    parents: torch.Tensor  # [batch, n] long: node i's parent (-1: the root)
    valid: torch.Tensor  # [batch, n] bool: a node of the row (the rest is padding)
    q: torch.Tensor | None  # [batch, n + 1, vocab]: what node i's (0: the root's) children
    # were drawn from; None: one-hot (every row greedy)
    tree: Tree  # the verify's depths and visibility, over the root and the n nodes
    width: int  # the most children a node has
    chain: int  # K: nodes [0, K) are the chains, the rest leaves
    point: torch.Tensor | None  # [batch] bool: candidates tried as point masses (tree.py)
    point_rows: list[bool] | None  # ``point`` on the host

    @property
    def node_ancestors(self) -> torch.Tensor:
        """``[batch, n, n]`` bool: node j is node i or one of its ancestors (tree.ancestors, as
        the verify's mask holds it)."""
        return self.tree.visible[:, 1:, 1:]


def grow(
    drafts: torch.Tensor,  # [batch, K] long: the chains
    num_draft: list[int],
    draft_probs: torch.Tensor | None,  # [batch, K, vocab]
    alts: Alternatives,  # [batch, K' <= K, S], and deeper nodes
    extra: list[int],  # nodes besides the chain per row (0: a chain)
) -> DraftTree:
    """The rows' trees (module docstring): each row's ``extra[b]`` most worth candidates (the
    runners-up and ``alts.more``; ties to the earlier id, so a kept node's ancestors are kept),
    in id order, in ``max(extra)`` columns after the K chain ones."""
    batch, k = drafts.shape
    dev = drafts.device
    n_leaf = max(extra)
    kk, s = alts.tokens.shape[1], alts.tokens.shape[2]
    chain_ok = torch.arange(k, device=dev)[None, :] < to_device(num_draft, torch.long, dev)[:, None]
    # candidates in id order (the runners-up, then the deeper nodes), ids past the chain's
    run_par = (torch.arange(kk, device=dev) - 1).repeat_interleave(s)  # [K' S]: d_j's node
    worth = alts.values.masked_fill(~chain_ok[:, :kk, None], float("-inf")).flatten(1)
    cand_tok, cand_par = alts.tokens.flatten(1), run_par[None].expand(batch, -1)
    if alts.more is not None:
        more_tok, more_val, more_par = alts.more
        cand_tok = torch.cat([cand_tok, more_tok], dim=1)  # [batch, M]
        worth = torch.cat([worth, more_val], dim=1)
        cand_par = torch.cat([cand_par, more_par], dim=1)
    m = worth.shape[1]
    order = torch.sort(worth, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(m, device=dev).expand(batch, -1))
    keep = (rank < to_device(extra, torch.long, dev)[:, None]) & (worth > float("-inf"))
    # the kept ones in id order, then the rest: [batch, n_leaf]
    ids = torch.arange(m, device=dev)[None, :]
    pick = torch.sort(torch.where(keep, ids, m + ids), dim=1).indices[:, :n_leaf]
    leaf_ok = keep.gather(1, pick)
    leaf_tok = cand_tok.gather(1, pick)
    new_id = torch.where(keep, k + keep.long().cumsum(1) - 1, -1)  # [batch, M]: its node
    par = cand_par.gather(1, pick)  # the parent's id: the root, a chain node or a candidate
    par_new = new_id.gather(1, (par - kk).clamp(0, m - 1))
    leaf_ok &= (par < kk) | (par_new >= 0)  # (an orphan is never tried: none is made)
    leaf_par = torch.where(par < kk, par, par_new).masked_fill(~leaf_ok, -1)
    tokens = torch.cat([drafts, leaf_tok], dim=1)  # [batch, n]
    chain_par = torch.arange(-1, k - 1, device=dev)[None, :].expand(batch, -1)
    parents = torch.cat([chain_par, leaf_par], dim=1)  # a runner-up of d_{j+1} hangs on d_j
    valid = torch.cat([chain_ok, leaf_ok], dim=1)
    n = tokens.shape[1]
    q = None
    if draft_probs is not None:  # node i < K - 1 of the chain: q of d_{i+2}; leaves: none
        q = draft_probs.new_zeros(batch, n + 1, draft_probs.shape[-1])
        q[:, :k] = draft_probs
    anc = ancestors(parents)  # [batch, n, n]
    d = anc.sum(-1)  # [batch, n]: each node's depth
    visible = torch.eye(n + 1, dtype=torch.bool, device=dev)[None].repeat(batch, 1, 1)
    visible[:, 1:, 0] = True  # every node sees the root
    visible[:, 1:, 1:] = anc
    tree = Tree(torch.cat([d.new_zeros(batch, 1), d], dim=1), visible)
    # a chain node has its chain child and S runners-up; a deeper node its branch
    width = 1 + min(max(s, alts.branch - 1), n_leaf)
    return DraftTree(tokens, parents, valid, q, tree, width, k, alts.point, alts.point_rows)


class Settled(NamedTuple):
    drafts: torch.Tensor  # [batch, K] long: the accepted path's tokens (padded past accepted)
    # [batch, K + 1, vocab]: the target's at each emitted position; None unless asked for
    probs: torch.Tensor | None
    tapped: torch.Tensor | None  # [batch, K + 1, features] at the same positions
    # [batch, 2] long: the row's leaves verified, and 1 where its path ended at one
    tree_stats: torch.Tensor


def settle(
    t: DraftTree,
    path: torch.Tensor,  # [batch, K] long: the accepted nodes, -1 past num_acc
    num_acc: torch.Tensor,  # [batch] long
    probs: torch.Tensor,  # [batch, n + 1, vocab] the target's at the root and after each node
    tapped: torch.Tensor | None,  # [batch, n + 1, features]
    cache: KVCache,
    slots: list[int],
    starts: list[int],  # each row's root position (its verify's first)
    *,
    want_probs: bool = True,  # False: nothing reads the emitted positions' probabilities
) -> Settled:
    """The accepted paths as chains, the target's cache moved to match (module docstring).
    ``want_probs``: gather the target's probabilities along the paths (logprobs read them; a
    copy of K + 1 vocabulary rows a row, skipped where no row asked)."""
    batch, k = path.shape
    dev = path.device
    i = torch.arange(k, device=dev)[None, :]
    node = torch.where(i < num_acc[:, None], path, i)  # [batch, K]: past the path, a chain's own
    idx = torch.cat([node.new_zeros(batch, 1), node + 1], dim=1)  # [batch, K + 1] query index
    drafts = t.tokens.gather(1, node)
    path_probs = None
    if want_probs:
        path_probs = probs.gather(1, idx[..., None].expand(-1, -1, probs.shape[-1]))
    if tapped is not None:
        tapped = tapped.gather(1, idx[..., None].expand(-1, -1, tapped.shape[-1]))
    start = to_device(starts, torch.long, dev)[:, None]
    cache.move(to_device(slots, torch.long, dev), start + idx[:, 1:], start + 1 + i)
    last = path.gather(1, (num_acc - 1).clamp_min(0)[:, None])[:, 0]
    leaf_hit = ((num_acc > 0) & (last >= t.chain)).long()
    leaves = t.valid[:, t.chain :].sum(1)
    return Settled(drafts, path_probs, tapped, torch.stack([leaves, leaf_hit], dim=1))
