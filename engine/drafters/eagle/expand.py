"""EAGLE-2's expansion of a draft tree around the chain (Li et al., EAGLE-2, "dynamic draft
trees"): deeper candidates than the chain's runners-up, from the same K head calls.

Terms as in engine/round/draft_tree.py. A tree row drafts its chain d_1..d_K as always; at each
depth j >= 1 the head is also fed the row's E = B - 1 most worth non-chain nodes of that depth
(its *extras*), in the chain's own call, each attending to the row's committed prefix and its own
ancestors (a mask); an extra's top B children become candidates of depth j + 1. The candidates of
depth j are the runners-up of d_j (:class:`~engine.drafters.eagle.drafter.RunnersUp`, children of
d_{j-1}) and the children of the extras of depth j - 1. Every candidate made goes to the round
(``Alternatives.more``), and draft_tree.grow keeps the row's L most worth.

Worth: the head's probability of the node's path (the product of q along it). A child is never
worth more than its parent, and ids grow from parents to children, so the L best (ties broken by
id) hold every kept node's ancestors.

A tree row drafts deterministically (the chain is each depth's top q too, a sampled row's
included): its candidates are verified each as a point mass (engine/round/tree.py), which keeps the
output distributed as the target's whatever chose them, so what the expansion reads to pick them
needs no care.

Layout of a tree row's head cache past ``real`` (its committed positions), never committed (the
drafter's commit rolls back to ``real``): d_j at column real + j - 1 (as a chain), extra e of
depth j at real + K + (j - 1) E + e (K: the round's widest chain), so W = K + (K - 1) E columns.

Node ids (the ``Alternatives`` space): chain node j (d_{j+1}) is j; runner-up r of d_{j+1} is
K + j S + r; the m-th child made by an extra is K + K S + m (made depth by depth, extra by extra,
in rank order).
"""

from __future__ import annotations

import torch

NEG = float("-inf")


class Expansion:
    """The extras and their children of a round's tree rows (dense over the batch: a row that is
    no tree, or drafts no more, keeps worth -inf)."""

    def __init__(self, batch: int, kmax: int, width: int, branch: int, hidden: int, dtype, device):
        self.k, self.s, self.b = kmax, width, branch  # K, the runners-up S, the children B
        self.e = branch - 1  # E extras a depth
        self.w = kmax + max(kmax - 1, 0) * self.e  # W: a row's tree columns
        m = max(kmax - 1, 0) * self.e * branch
        self.tokens = torch.zeros(batch, m, dtype=torch.long, device=device)  # every child made
        self.values = torch.full((batch, m), NEG, device=device)
        self.parents = torch.full((batch, m), -1, dtype=torch.long, device=device)
        e = self.e
        # the extras fed last: worth, id, head output, visible tree columns
        self.ext_val = torch.full((batch, e), NEG, device=device)  # [batch, E]
        self.ext_id = torch.zeros(batch, e, dtype=torch.long, device=device)
        self.ext_out = torch.zeros(batch, e, hidden, dtype=dtype, device=device)
        self.ext_bits = torch.zeros(batch, e, self.w, dtype=torch.bool, device=device)
        self.cols = torch.arange(self.w, device=device)  # [W]
        self.kid = torch.arange(e * branch, device=device)  # [E B] a depth's children, in order
        # whose output a depth's candidate is fed with: 0 the chain's (a runner-up), 1 + e
        # extra e's (its child)
        self.src = torch.cat([self.kid.new_zeros(width), 1 + self.kid // branch])

    def chain_bits(self, j: int, rows: int) -> torch.Tensor:
        """``[rows, W]``: what d_j (fed at step j) sees of the tree: d_1..d_j."""
        return (self.cols < j)[None].expand(rows, -1)

    def select(
        self,
        j: int,
        rows_t: torch.Tensor,  # [R] the tree rows drafting at step j (batch indices)
        chain_out: torch.Tensor,  # [R, hidden] the head's output at d_{j-1} (the root at j = 1)
        run_tok: torch.Tensor,  # [R, S] the runners-up of d_j (target ids)
        run_val: torch.Tensor,  # [R, S] their worth
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The extras of depth j: the E most worth of d_j's runners-up and the children of the
        extras of depth j - 1. Returns their tokens ``[R E]``, inputs ``[R E, hidden]`` (their
        parent's output) and visible tree columns ``[R E, W]``."""
        r, s, e = rows_t.shape[0], self.s, self.e
        tok, val = run_tok, run_val  # [R, S], then the children of depth j - 1's extras
        ids = (self.k + (j - 1) * s + torch.arange(s, device=rows_t.device))[None].expand(r, -1)
        if j > 1:
            at = self.made(j - 1)
            tok = torch.cat([tok, self.tokens[rows_t, at]], dim=1)  # [R, S + E B]
            val = torch.cat([val, self.values[rows_t, at]], dim=1)
            ids = torch.cat([ids, self.more_ids(j - 1)[None].expand(r, -1)], dim=1)
        src = self.src[: tok.shape[1]][None].expand(r, -1)
        best = torch.sort(val, dim=1, descending=True, stable=True).indices[:, :e]  # [R, E]
        outs = torch.cat([chain_out[:, None], self.ext_out[rows_t]], dim=1)  # [R, 1 + E, hidden]
        bits = torch.cat([self.chain_bits(j - 1, r)[:, None], self.ext_bits[rows_t]], dim=1)
        pick_src = src.gather(1, best)  # [R, E]
        x = outs.gather(1, pick_src[..., None].expand(-1, -1, outs.shape[-1]))  # [R, E, hidden]
        vis = bits.gather(1, pick_src[..., None].expand(-1, -1, self.w)).clone()  # [R, E, W]
        vis[:, torch.arange(e), self.columns(j)] = True  # each sees itself
        self.ext_val[rows_t] = val.gather(1, best)
        self.ext_id[rows_t] = ids.gather(1, best)
        self.ext_bits[rows_t] = vis
        return tok.gather(1, best).flatten(), x.flatten(0, 1), vis.flatten(0, 1)

    def columns(self, j: int) -> torch.Tensor:
        """``[E]``: the tree columns of the extras of depth j."""
        return self.k + (j - 1) * self.e + self.kid[: self.e]

    def made(self, j: int) -> slice:
        """Where the children of the extras of depth j are recorded (``tokens``, ...)."""
        n = self.e * self.b
        return slice((j - 1) * n, j * n)

    def more_ids(self, j: int) -> torch.Tensor:
        """``[E B]``: the ids of the children of the extras of depth j (module docstring)."""
        return self.k + self.k * self.s + (j - 1) * self.e * self.b + self.kid

    def children(
        self,
        j: int,
        rows_t: torch.Tensor,  # [R]
        out: torch.Tensor,  # [R E, hidden] the head's output at the extras of depth j
        q: torch.Tensor,  # [R E, draft_vocab] the head's distribution there
        draft_ids: torch.Tensor,  # [draft_vocab] target id of each draft id
    ) -> None:
        """Record the top B children of each extra of depth j (candidates of depth j + 1)."""
        r, e, b = rows_t.shape[0], self.e, self.b
        top = q.topk(b, dim=-1)  # [R E, B]
        parent = self.ext_val[rows_t].reshape(r * e, 1)
        val = torch.where((parent > NEG) & (top.values > 0), parent * top.values, NEG)
        self.ext_out[rows_t] = out.reshape(r, e, -1).to(self.ext_out.dtype)
        at = self.made(j)
        self.tokens[rows_t, at] = draft_ids[top.indices].reshape(r, e * b)
        self.values[rows_t, at] = val.reshape(r, e * b)
        self.parents[rows_t, at] = self.ext_id[rows_t].repeat_interleave(b, dim=1)
