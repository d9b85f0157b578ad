"""The exact speculative acceptance rule, as a pure function over tensors (no model inside).

Terms, used across the engine:
  K          draft length of a row in one round (K_i; rows of a batch differ, 0 allowed).
  drafted    the K tokens d_1..d_K the drafter proposed for a row.
  accepted   the leading drafted tokens the rule keeps (a of them, 0 <= a <= K).
  recovered  the token emitted at the first rejected position a+1 < K+1, sampled from
             norm(max(p - q, 0)) (greedy: the target's argmax there).
  bonus      the token emitted after all K drafts were accepted, sampled from the target's
             distribution at position K+1 (greedy: its argmax). A round therefore emits a + 1
             tokens from one target pass.

Rule (Leviathan et al. 2023; Chen et al. 2023): accept d_j with probability min(1, p(d_j)/q(d_j))
in order, stop at the first rejection. A deterministic drafter (n-gram lookup) has a one-hot q,
so accept with probability p(d_j) and recover from p with d_j removed. Greedy rows accept while
d_j equals the target's argmax. The output is distributed exactly as the target alone.

When every row is greedy the caller passes no ``noise``: then only argmaxes are taken, and
``target_probs`` may be any scores with the target's argmax (the round passes its logits and
skips the softmax).

Randomness comes in as tensors (``uniforms``, ``noise``) drawn by the caller from each request's
own generator, so this function is deterministic and testable. A categorical sample is taken as an
exponential race (engine/sampling/probs.py ``race``).
"""

from __future__ import annotations

import torch

from engine.sampling.probs import race


def rejection_sample(
    target_probs: torch.Tensor,  # [batch, K+1, vocab] target distribution at each verified position
    draft_tokens: torch.Tensor,  # [batch, K] long, padded past each row's num_draft
    num_draft: torch.Tensor,  # [batch] long, K_i <= K
    draft_probs: torch.Tensor
    | None,  # [batch, K, vocab], or None for a one-hot (deterministic) drafter
    greedy: torch.Tensor,  # [batch] bool
    uniforms: torch.Tensor,  # [batch, K] in [0, 1)
    noise: torch.Tensor | None,  # [batch, vocab] Exp(1) draws for the recovered/bonus sample;
    # None: every row is greedy
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(num_accepted [batch], next_token [batch])``; row b emits
    ``draft_tokens[b, :num_accepted[b]]`` followed by ``next_token[b]``."""
    batch, k1, _ = target_probs.shape
    k = k1 - 1
    rows = torch.arange(batch, device=target_probs.device)
    valid = torch.arange(k, device=num_draft.device)[None, :] < num_draft[:, None]  # [batch, K]
    if noise is None:  # every row greedy: accept while d_j is the argmax, then emit the argmax
        top = target_probs.argmax(-1)  # [batch, K+1]
        accept = (draft_tokens == top[:, :k]) & valid  # [batch, K]
        num_accepted = accept.long().cumprod(-1).sum(-1)  # [batch]
        return num_accepted, top[rows, num_accepted]
    if k > 0:
        p_tok = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, K]
        if draft_probs is None:
            q_tok = torch.ones_like(p_tok)
        else:
            q_tok = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [batch, K]
        sampled_accept = uniforms * q_tok < p_tok  # u < p/q without dividing by q
        greedy_accept = draft_tokens == target_probs[:, :k].argmax(-1)
        accept = torch.where(greedy[:, None], greedy_accept, sampled_accept) & valid
        num_accepted = accept.long().cumprod(-1).sum(-1)  # [batch]
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=target_probs.device)

    p_next = target_probs[rows, num_accepted]  # [batch, vocab]
    dist = p_next
    if k > 0:
        rejected = num_accepted < num_draft  # [batch]
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            rejected_tok = draft_tokens[rows, at]
            residual = p_next.scatter(-1, rejected_tok[:, None], 0.0)  # p - onehot, clamped at 0
        else:
            residual = (p_next - draft_probs[rows, at]).clamp_min(0.0)  # [batch, vocab]
        # p == q exactly leaves no residual mass (then rejection had probability 0); keep p.
        has_mass = residual.sum(-1, keepdim=True) > 0
        dist = torch.where(rejected[:, None] & has_mass, residual, p_next)
    sampled = race(dist, noise)
    next_token = torch.where(greedy, p_next.argmax(-1), sampled)
    return num_accepted, next_token
