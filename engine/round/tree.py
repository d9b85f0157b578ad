"""Draft trees: the exact acceptance rule over a tree of drafted tokens, and its attention mask.

A row's tree (terms as in rejection.py, for a chain):
  root       the row's last committed token; the verify feeds it first (query 0).
  node i     a drafted token (0 <= i < n), fed as query i + 1; ``parents[i]`` is its parent
             node, -1 for the root's children. Parents come before their children (parents[i] <
             i), and a node's children, in index order, are the *candidates* tried at it.
  path       the accepted nodes from the root down; a round emits them and one more token.

Verify: every node attends to the committed prefix, the root and its own ancestors
(:func:`ancestors`), at position ``start + depth`` (:func:`depths`), so query i + 1 computes the
target's distribution after the path to node i; ``target_probs[:, i + 1]`` is it, and
``target_probs[:, 0]`` the root's.

Rule, one node at a time from the root (greedy: walk to the child whose token is the target's
argmax; none: emit the argmax). Sampled (multi-candidate recursive rejection sampling, SpecInfer,
Miao et al. 2024; without replacement as in Yang et al. 2024, "Multi-candidate speculative
decoding"): at a node with target distribution p and draft distribution q, whose candidates
x_1, x_2, ... were drawn from q *without replacement*, try them in order with

    q_i = q with x_1 .. x_{i-1} removed, renormalised
    accept x_i with probability min(1, p_{i-1}(x_i) / q_i(x_i)), p_0 = p
    else p_i = norm(max(p_{i-1} - q_i, 0))

and move to the accepted child (its own p and q), or, when every candidate is rejected, emit a
sample of the last residual (no candidates: of p itself). Invariant: given the node's context,
the token it emits or accepts is distributed as p. Each try is one step of the chain's rule
(rejection.py) for the target p_{i-1} and the proposal q_i, whose residual is exactly the
distribution left to sample; and x_i, drawn after x_1..x_{i-1}, *is* a draw from q_i whatever
the rejections before it. So candidates must be a sample of q without replacement (a Gumbel
top-k), and a kept subset must be a prefix of that order: the first-choice candidates of a
deterministic top-k are not a sample of q, and a rule that tries a sibling against q itself,
not q_i, over-accepts the second one.

Chosen candidates (a row drafted deterministically, e.g. its head's top q: EAGLE-2's expansion,
drafters/eagle/expand.py) are each tried as a point mass: q_i = the point mass at x_i, so x_i is
accepted with probability p_{i-1}(x_i) and p_i is p_{i-1} without x_i, renormalised. That is the
same step with a proposal that put all its mass on x_i, exact whatever chose x_i, as long as
nothing of the target's draws did; a rule that kept x_i in p_i would emit it too often.

Where every row is greedy or tries its candidates as point masses, a node's test needs nothing
of the outcomes before it (the earlier siblings' removal only renormalises), so the walk has a
closed form (:func:`closed_walk`): a few batched ops, not a loop over depths and candidates.
"""

from __future__ import annotations

import torch

from engine.sampling.probs import race


def depths(parents: torch.Tensor) -> torch.Tensor:
    """``parents`` [batch, n] long (-1: the root's child) -> each node's depth [batch, n]
    (the root's children 1): how many nodes its line holds, itself included."""
    return ancestors(parents).sum(-1)


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """``[batch, n, n]`` bool: node j is node i or one of its ancestors (the root excluded).
    Padding nodes may name any parent. The parent relation's reflexive closure raised to its
    2^m-th power reaches every line of up to 2^m edges: log2(n) batched products, not a step a
    node (a tree round's host time on CPU is a few hundred small ops)."""
    n = parents.shape[1]
    ids = torch.arange(n, device=parents.device)
    reach = ((parents[:, :, None] == ids) | (ids[:, None] == ids)).float()  # [batch, n, n]
    span = 1  # the longest line reach covers, in edges
    while span < n - 1:
        reach = (torch.bmm(reach, reach) > 0).float()
        span *= 2
    return reach > 0


def without(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q ``[batch, vocab]`` (unnormalised) with the rejected candidates ``x`` ``[batch]`` taken
    out: what the next sibling was drawn from (the rule's q_i)."""
    return q.scatter(-1, x[:, None], 0.0)


def tree_accept(
    target_probs: torch.Tensor,  # [batch, n+1, vocab] p at the root (0) and after node i (i+1)
    tokens: torch.Tensor,  # [batch, n] long: each node's drafted token
    parents: torch.Tensor,  # [batch, n] long: each node's parent (-1: root); parents[i] < i
    valid: torch.Tensor,  # [batch, n] bool: the row's nodes (the rest is padding)
    draft_probs: torch.Tensor | None,  # [batch, n+1, vocab] q its children were drawn from;
    # None: every row is greedy
    greedy: torch.Tensor,  # [batch] bool
    uniforms: torch.Tensor,  # [batch, n] in [0, 1): node i's acceptance test
    noise: torch.Tensor | None,  # [batch, vocab] Exp(1) for the emitted sample; None: all greedy
    *,
    depth: int,  # the deepest node's depth (host int: the loops need no device sync)
    width: int,  # the most children a node has
    point: torch.Tensor | None = None,  # [batch] bool: rows whose candidates were chosen, not
    # drawn: each tried as a point mass (module docstring)
    every_point: bool = False,  # host: every row is greedy or a ``point`` row (closed form)
    anc: torch.Tensor | None = None,  # [batch, n, n] :func:`ancestors` of ``parents``, where the
    # caller holds it (the tree's attention mask); None: computed here
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(path [batch, depth] long, num_accepted [batch], next_token [batch])``: row b
    emits ``tokens[b, path[b, :num_accepted[b]]]`` then ``next_token[b]`` (path padded with
    -1). No device -> host sync."""
    if noise is None:  # every row greedy
        return closed_walk(target_probs, tokens, parents, valid, depth, anc=anc)
    if every_point:
        return closed_walk(
            target_probs, tokens, parents, valid, depth, greedy, uniforms, noise, anc=anc
        )
    batch, n = tokens.shape
    dev = tokens.device
    rows = torch.arange(batch, device=dev)
    real = valid
    cur = torch.full((batch,), -1, dtype=torch.long, device=dev)  # the node a row stands at
    walking = torch.ones(batch, dtype=torch.bool, device=dev)
    path = torch.full((batch, depth + 1), -1, dtype=torch.long, device=dev)  # last: scratch
    num_accepted = torch.zeros(batch, dtype=torch.long, device=dev)
    p = target_probs[:, 0].clone()  # [batch, vocab] what is left to sample at ``cur``
    q = draft_probs[:, 0].clone() if draft_probs is not None else None  # untried candidates' q
    node_ids = torch.arange(n, device=dev)[None, :]
    for _ in range(depth):
        children = (parents == cur[:, None]) & real & walking[:, None]  # [batch, n]
        rank = children.long().cumsum(-1) - 1  # [batch, n]: a child's place among its siblings
        accepted = torch.zeros(batch, dtype=torch.bool, device=dev)
        for r in range(width):
            is_r = children & (rank == r)  # [batch, n]: at most one per row
            trying = is_r.any(-1) & ~accepted  # [batch]
            cand = torch.where(is_r, node_ids, n).min(-1).values.clamp(max=n - 1)  # [batch]
            x = tokens[rows, cand]  # [batch]
            argmax_ok = x == target_probs[rows, cur + 1].argmax(-1)
            if q is not None or point is not None:
                if q is not None:
                    q_norm = q / q.sum(-1, keepdim=True).clamp_min(1e-30)  # q_i
                else:
                    q_norm = torch.zeros_like(p)
                if point is not None:  # q_i = the point mass at x
                    hot = torch.zeros_like(p).scatter_(1, x[:, None], 1.0)
                    q_norm = torch.where(point[:, None], hot, q_norm)
                q_x = q_norm[rows, x]
                sampled_ok = uniforms[rows, cand] * q_x < p[rows, x]  # u < p(x) / q_i(x)
                ok = torch.where(greedy, argmax_ok, sampled_ok) & trying
                # rejected: p <- norm(max(p - q_i, 0)) (no mass left: p == q_i, kept), and x
                # leaves q for the next sibling
                reject = trying & ~ok & ~greedy
                residual = (p - q_norm).clamp_min(0.0)
                mass = residual.sum(-1, keepdim=True)
                residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
                p = torch.where(reject[:, None], residual, p)
                if q is not None:
                    q = torch.where(reject[:, None], without(q, x), q)
            else:
                ok = argmax_ok & trying
            accepted |= ok
            # an accepted candidate: the row stands at it, with its own p and q
            path[rows, num_accepted] = torch.where(ok, cand, path[rows, num_accepted])
            num_accepted = num_accepted + ok.long()
            cur = torch.where(ok, cand, cur)
            p = torch.where(ok[:, None], target_probs[rows, cand + 1], p)
            if q is not None and draft_probs is not None:
                q = torch.where(ok[:, None], draft_probs[rows, cand + 1], q)
        walking = walking & accepted
    path = path[:, :depth]
    greedy_tok = target_probs[rows, cur + 1].argmax(-1)
    return path, num_accepted, torch.where(greedy, greedy_tok, race(p, noise))


def closed_walk(
    target_probs: torch.Tensor,  # [batch, n+1, vocab] (or logits if all greedy): root's, node i's
    tokens: torch.Tensor,  # [batch, n] long
    parents: torch.Tensor,  # [batch, n] long; parents[i] < i for the row's nodes
    valid: torch.Tensor,  # [batch, n] bool
    depth: int,  # the walk's most steps
    greedy: torch.Tensor | None = None,  # [batch] bool; None: every row greedy
    uniforms: torch.Tensor | None = None,  # [batch, n]: node i's test (sampled rows)
    noise: torch.Tensor | None = None,  # [batch, vocab] Exp(1): the emitted sample
    *,
    anc: torch.Tensor | None = None,  # [batch, n, n] :func:`ancestors` (None: computed here)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule in closed form for rows that are greedy or try every candidate as a point mass
    (module docstring), no loop over depths and candidates; returns as :func:`tree_accept`.

    Node i *passes* its test: greedy, when its token is the target's argmax after its parent;
    a point mass x_i, when u_i < p_{i-1}(x_i) = p(x_i) / (1 - the sum of p(x_j) over its
    earlier siblings j), p its parent's distribution (the earlier siblings taken out and
    renormalised, as the rule does once they are rejected; the test needs no outcome before
    it). Node i is *taken* when it passes and no earlier sibling does: the rule tries a node's
    children in id order and moves to the first that passes. The path is the nodes whose whole
    line, down to themselves, is taken: at most one a depth, in id order as parents come first.
    The row then emits, at the path's last node (or the root), the argmax (greedy) or a sample
    of p with the node's children (all tried, all rejected) taken out. A sibling repeating an
    earlier one's token never passes (the rule took that token out of p when it rejected the
    first)."""
    batch, n = tokens.shape
    vocab = target_probs.shape[-1]
    ids = torch.arange(n, device=tokens.device)
    at = parents.clamp_min(-1) + 1  # [batch, n]: the query of each node's parent
    top = target_probs.argmax(-1)  # [batch, n+1]
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (ids < ids[:, None])
    earlier_sibling &= valid[:, None, :]  # [batch, n, n]: j an earlier sibling of i
    passes = tokens == top.gather(1, at)  # [batch, n]
    if noise is not None:
        assert greedy is not None and uniforms is not None
        p_x = target_probs.flatten(1).gather(1, at * vocab + tokens)  # [batch, n]: p(x_i)
        # a token an earlier sibling already tried is out of p (p_{i-1}(x_i) = 0), once
        repeat = (earlier_sibling & (tokens[:, :, None] == tokens[:, None, :])).any(-1)
        p_x = p_x.masked_fill(repeat, 0.0)
        before = (earlier_sibling * p_x[:, None, :]).sum(-1)  # [batch, n]
        mass = target_probs.sum(-1).gather(1, at) - before  # [batch, n]: p_{i-1}'s, unnormalised
        sampled = uniforms * mass.clamp_min(0.0) < p_x
        passes = torch.where(greedy[:, None], passes, sampled)
    passes &= valid
    taken = passes & ~(earlier_sibling & passes[:, None, :]).any(-1)  # [batch, n]
    anc = ancestors(parents) if anc is None else anc  # [batch, n, n]
    node_depth = anc.sum(-1)  # [batch, n]
    on = ~(anc & ~taken[:, None, :]).any(-1) & (node_depth <= depth)  # [batch, n]
    num_accepted = on.sum(1)
    path = torch.sort(torch.where(on, ids, n + ids), dim=1).indices[:, :depth]
    cols = torch.arange(path.shape[1], device=ids.device)
    path = torch.where(cols < num_accepted[:, None], path, -1)
    last = torch.where(on, ids, -1).max(1).values  # [batch]: -1, the root
    next_tok = top.gather(1, (last + 1)[:, None])[:, 0]
    if noise is None:
        return path, num_accepted, next_tok
    assert greedy is not None
    rows = torch.arange(batch, device=tokens.device)
    p = target_probs[rows, last + 1]  # [batch, vocab]
    # the last node's children, all tried and rejected (none past the walk's depth: untried)
    last_depth = torch.where(last >= 0, node_depth.gather(1, last.clamp_min(0)[:, None])[:, 0], 0)
    tried = valid & (parents == last[:, None]) & (last_depth < depth)[:, None]
    tried = tried.to(p.dtype)  # [batch, n]
    out = torch.zeros_like(p).scatter_add_(1, tokens, tried) > 0  # [batch, vocab]
    rest = p.masked_fill(out, 0.0)
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)  # (no mass left: p, as the rule)
    return path, num_accepted, torch.where(greedy, next_tok, race(rest, noise))
