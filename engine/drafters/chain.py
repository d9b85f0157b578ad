"""The draft chain of a model drafter (a draft model, the EAGLE-3 head): draft position by
position, the rows still drafting in one batch.

At position j the rows whose K is above j take one step of the drafter, which returns its logits
there, and each row chooses its draft d_{j+1} from them (with q, the distribution it was drawn
from, when a row samples). A row whose K is reached leaves the batch before the next step, so a
step never computes a row that drafts no more. Grammar rows draft under their grammar's mask
(:class:`~engine.sampling.grammar.DraftGrammar`), whose matchers are rolled back at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from engine.drafters.base import Proposal
from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence
from engine.sampling.grammar import DraftGrammar
from engine.transfer import to_device


class RowParams(NamedTuple):
    """The sampling parameters of the rows still drafting, in their order."""

    temperature: torch.Tensor  # [rows]
    top_k: torch.Tensor  # [rows]
    top_p: torch.Tensor  # [rows]
    greedy: torch.Tensor  # [rows] bool


class Position(NamedTuple):
    """Where the chain stands when a step runs."""

    j: int  # the draft position: d_{j+1} is chosen from this step's logits
    rows: list[int]  # the batch rows still drafting
    keep: torch.Tensor | None  # [rows]: which of the previous step's rows remain (None: all)
    prev: torch.Tensor | None  # [rows] the previous position's drafts (None at j = 0)


# (position, the drafter's state) -> (logits [rows, vocab'] at the position, the new state)
Step = Callable[[Position, Any], tuple[torch.Tensor, Any]]
# (logits, rows, rows on the device, j, their parameters, the grammar rows) -> (drafts [rows],
# q [rows, vocab] or None)
Choose = Callable[
    [torch.Tensor, list[int], torch.Tensor, int, RowParams, DraftGrammar],
    tuple[torch.Tensor, torch.Tensor | None],
]


def draft_chain(
    seqs: list[Sequence],
    plan: RoundPlan,
    vocab_size: int,
    sampled: bool,
    step: Step,
    choose: Choose,
) -> Proposal:
    """Draft up to ``plan.ks[b]`` tokens for each row of ``seqs``. ``sampled``: report q (some
    row samples; an all-greedy batch reports none, one-hot q)."""
    ks, dev = plan.ks, plan.temperature.device
    kmax = max(ks)
    tokens = torch.zeros(len(seqs), kmax, dtype=torch.long, device=dev)  # [batch, K]
    # [batch, K, vocab]: the draft distributions of the positions drafted
    probs = torch.zeros(len(seqs), kmax, vocab_size, device=dev) if sampled else None
    rows = [b for b, k in enumerate(ks) if k > 0]
    if not rows:
        return Proposal(tokens, list(ks), probs)
    idx = to_device(rows, torch.long, dev)
    params = RowParams(plan.temperature[idx], plan.top_k[idx], plan.top_p[idx], plan.greedy[idx])
    guide = DraftGrammar(seqs)
    state: Any = None
    tok: torch.Tensor | None = None
    for j in range(kmax):
        keep = None
        active = [i for i, b in enumerate(rows) if ks[b] > j]
        if len(active) < len(rows):  # rows whose K is reached leave the draft batch
            rows = [rows[i] for i in active]
            keep = to_device(active, torch.long, dev)
            params = RowParams(*(t[keep] for t in params))
            tok = tok[keep] if tok is not None else None
        logits, state = step(Position(j, rows, keep, tok), state)
        row_t = to_device(rows, torch.long, dev)
        tok, q = choose(logits, rows, row_t, j, params, guide)
        tokens[row_t, j] = tok
        if probs is not None and q is not None:
            probs[row_t, j] = q
        if guide:
            guide.took(tok.tolist(), rows)
    guide.close()
    return Proposal(tokens, list(ks), probs)
