"""A round's draft trees: the drafted chain plus the drafter's best runners-up as leaves, verified
in one target forward and accepted by the tree rule (tree.py), then laid out as a chain again.

Shape (terms as in tree.py): a row's nodes are its chain d_1..d_K (nodes 0..K-1, each the child
of the one before) followed by ``extra`` runner-up leaves (nodes K..K+extra-1): a runner-up of
d_{j+1} (drafters/base.py ``Alternatives``) is a child of d_j, the root's for j = 0, tried after
d_{j+1}. The leaves kept are the row's ``extra`` most worth (their estimated chance of being
accepted); within a position worth decreases in the order drawn, so the kept runners-up of a
position are a prefix of that order, as the rule needs. A row with ``extra`` = 0 is a plain chain
in the same forward: a batch mixes trees and chains.

Why chain + leaves: the head drafts the chain in K sequential steps either way, and its runners-up
come from the logits it already computed, so a tree costs the drafter nothing more; the verify's
extra queries are the whole price, and the controller weighs them (kcontrol/controller.py).

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
from engine.model.kv_cache import SlotKVCache
from engine.model.tree_attention import Tree
from engine.requests.sequence import Sequence
from engine.round.tree import ancestors, depths
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


def grow(
    drafts: torch.Tensor,  # [batch, K] long: the chains
    num_draft: list[int],
    draft_probs: torch.Tensor | None,  # [batch, K, vocab]
    alts: Alternatives,  # [batch, K' <= K, S]
    extra: list[int],  # leaves per row (0: a chain)
) -> DraftTree:
    """The rows' trees (module docstring); ``max(extra)`` leaf columns after the K chain ones."""
    batch, k = drafts.shape
    dev = drafts.device
    n_leaf = max(extra)
    kk, s = alts.tokens.shape[1], alts.tokens.shape[2]
    chain_ok = torch.arange(k, device=dev)[None, :] < to_device(num_draft, torch.long, dev)[:, None]
    # leaves: the row's n_leaf best runners-up, of positions it drafted
    worth = alts.values.masked_fill(~chain_ok[:, :kk, None], float("-inf")).flatten(1)
    best = worth.topk(min(n_leaf, kk * s), dim=-1)  # [batch, n_leaf']
    pos = best.indices // s  # [batch, n_leaf']: the position j whose runner-up it is
    leaf_tok = alts.tokens.flatten(1).gather(1, best.indices)
    leaf_ok = (best.values > float("-inf")) & (
        torch.arange(best.indices.shape[1], device=dev)[None, :]
        < to_device(extra, torch.long, dev)[:, None]
    )
    tokens = torch.cat([drafts, leaf_tok], dim=1)  # [batch, n]
    chain_par = torch.arange(-1, k - 1, device=dev)[None, :].expand(batch, -1)
    parents = torch.cat([chain_par, pos - 1], dim=1)  # a runner-up of d_{j+1} hangs on d_j
    valid = torch.cat([chain_ok, leaf_ok], dim=1)
    n = tokens.shape[1]
    q = None
    if draft_probs is not None:  # node i < K - 1 of the chain: q of d_{i+2}; leaves: none
        q = draft_probs.new_zeros(batch, n + 1, draft_probs.shape[-1])
        q[:, :k] = draft_probs
    d = depths(parents)  # [batch, n]
    visible = torch.eye(n + 1, dtype=torch.bool, device=dev)[None].repeat(batch, 1, 1)
    visible[:, 1:, 0] = True  # every node sees the root
    visible[:, 1:, 1:] = ancestors(parents)
    tree = Tree(torch.cat([d.new_zeros(batch, 1), d], dim=1), visible)
    # leaves in decreasing worth: a position's in their order drawn, tried after its chain node
    return DraftTree(tokens, parents, valid, q, tree, 1 + min(s, pos.shape[1]), k)


class Settled(NamedTuple):
    drafts: torch.Tensor  # [batch, K] long: the accepted path's tokens (padded past accepted)
    probs: torch.Tensor  # [batch, K + 1, vocab]: the target's at each emitted position
    tapped: torch.Tensor | None  # [batch, K + 1, features] at the same positions
    # [batch, 2] long: the row's leaves verified, and 1 where its path ended at one
    tree_stats: torch.Tensor


def settle(
    t: DraftTree,
    path: torch.Tensor,  # [batch, K] long: the accepted nodes, -1 past num_acc
    num_acc: torch.Tensor,  # [batch] long
    probs: torch.Tensor,  # [batch, n + 1, vocab] the target's at the root and after each node
    tapped: torch.Tensor | None,  # [batch, n + 1, features]
    cache: SlotKVCache,
    slots: list[int],
    starts: list[int],  # each row's root position (its verify's first)
) -> Settled:
    """The accepted paths as chains, the target's cache moved to match (module docstring)."""
    batch, k = path.shape
    dev = path.device
    i = torch.arange(k, device=dev)[None, :]
    node = torch.where(i < num_acc[:, None], path, i)  # [batch, K]: past the path, a chain's own
    idx = torch.cat([node.new_zeros(batch, 1), node + 1], dim=1)  # [batch, K + 1] query index
    drafts = t.tokens.gather(1, node)
    probs = probs.gather(1, idx[..., None].expand(-1, -1, probs.shape[-1]))
    if tapped is not None:
        tapped = tapped.gather(1, idx[..., None].expand(-1, -1, tapped.shape[-1]))
    start = to_device(starts, torch.long, dev)[:, None]
    cache.move(to_device(slots, torch.long, dev), start + idx[:, 1:], start + 1 + i)
    last = path.gather(1, (num_acc - 1).clamp_min(0)[:, None])[:, 0]
    leaf_hit = ((num_acc > 0) & (last >= t.chain)).long()
    leaves = t.valid[:, t.chain :].sum(1)
    return Settled(drafts, probs, tapped, torch.stack([leaves, leaf_hit], dim=1))


def may_grow(seq: Sequence) -> bool:
    """Whether a row may be verified as a tree: not under a grammar, penalties or logit bias
    (their processing reads a row's drafts as a chain: penalties.py, grammar.py), nor seeded (a
    seeded row's draws follow its own K alone: plan.py) or deterministic (the batch-invariant
    forward verifies chains)."""
    p = seq.params
    return seq.matcher is None and not p.penalized and p.seed is None and not p.deterministic
