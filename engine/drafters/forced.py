"""Tokens a grammar forces, drafted for free.

Where a row's grammar leaves only one way on (the rest of ``{"name": "`` once ``{"`` is written,
a closing ``"}``), llguidance names the tokens that spell the forced bytes
(``compute_ff_tokens``). The round drafts them instead of asking the drafter: a forced run is a
draft of a deterministic drafter, q one-hot on each forced token, so the rejection rule keeps the
output exactly the (masked) target's whatever the run is (a forced token the target's masked p
gives probability 1 is accepted for certain; one it does not, because another tokenization of the
same bytes is allowed too, is accepted with probability p(token), as any one-hot draft). Such a
round costs one verify pass and no drafting step, and emits the whole run plus the token after it.

Invariants:
  * A row gets a forced run only when it may draft (``cap`` > 0: speculation on, room left) and
    its K is not pinned to 0 (``kcontrol.controller.pinned_k``: a request's own
    ``speculation.k`` of 0, or a seeded sampled request without one, whose random draws are
    consumed per drafted token).
  * A forced row is not asked to draft (the drafter sees K = 0 for it) and its run replaces its
    drafts; the other rows' proposals are untouched.
  * The matcher is only read (``compute_ff_tokens`` does not move it).
"""

from __future__ import annotations

import torch

from engine.kcontrol.controller import pinned_k
from engine.records.sequence import Sequence
from engine.transfer import to_device


def forced_run(seq: Sequence, cap: int) -> list[int]:
    """The tokens ``seq``'s grammar forces next, at most ``cap`` (empty: none, or not allowed:
    no room, or a K pinned to 0, kcontrol.controller.pinned_k)."""
    m = seq.matcher
    if m is None or pinned_k(seq, cap) == 0 or m.is_stopped():
        return []
    return list(m.compute_ff_tokens()[:cap])


def with_forced(
    drafts: torch.Tensor,  # [batch, K] the drafter's proposal (padded past num_draft[b])
    num_draft: list[int],
    draft_probs: torch.Tensor | None,  # [batch, K, vocab] q; None: one-hot on the drafts
    forced: list[list[int]],  # each row's forced run (empty: keep the drafter's)
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """The proposal with every forced row's drafts replaced by its forced run (q one-hot on it),
    widened to the longest run: (drafts [batch, K'], num_draft, draft_probs [batch, K', vocab])."""
    batch, width = drafts.shape
    wide = max([width] + [len(f) for f in forced])
    if wide > width:
        drafts = torch.cat([drafts, drafts.new_zeros(batch, wide - width)], dim=1)
        if draft_probs is not None:
            pad = draft_probs.new_zeros(batch, wide - width, draft_probs.shape[-1])
            draft_probs = torch.cat([draft_probs, pad], dim=1)
    drafts, num_draft = drafts.clone(), list(num_draft)
    if draft_probs is not None:
        draft_probs = draft_probs.clone()
    for b, run in enumerate(forced):
        if not run:
            continue
        ids = to_device(run, torch.long, drafts.device)
        drafts[b] = 0
        drafts[b, : len(run)] = ids
        num_draft[b] = len(run)
        if draft_probs is not None:
            draft_probs[b] = 0.0
            draft_probs[b, torch.arange(len(run), device=drafts.device), ids] = 1.0
    return drafts, num_draft, draft_probs
