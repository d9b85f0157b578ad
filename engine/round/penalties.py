"""Logit bias and repetition penalties, applied to the target's logits at every verified position
before temperature / top-k / top-p (sampling/probs.py).

Formulas, for token j with count c_j (how often j occurs in the output before the position):
  * OpenAI's:   l_j += logit_bias[j];  l_j -= c_j * frequency_penalty + [c_j > 0] * presence_penalty
  * repetition_penalty r (CTRL; transformers' and vLLM's), for j in the prompt or the output so
    far: l_j <- l_j / r if l_j > 0 else l_j * r.
Order: repetition penalty, then frequency / presence, then bias (vLLM's order).

Exactness under speculation: verify position i of a row (the distribution of the token after
d_1..d_i) sees the output *including the drafts before it*: counts c + counts(d_1..d_i). Each
position is therefore processed exactly as plain decoding would process it had those drafts been
emitted, so the rejection rule's output is distributed as the processed target's (and greedy
output equals processed greedy decoding). Rows without any processing are untouched: the round
pays nothing for them.
"""

from __future__ import annotations

import torch

from engine.records.sequence import Sequence
from engine.transfer import to_device


def apply_penalties(
    logits: torch.Tensor,  # [batch, k+1, vocab] the target's logits at each verified position
    seqs: list[Sequence],
    drafts: torch.Tensor,  # [batch, K] long: the drafts d_1..d_K verified (K = k+1 - 1 or more)
) -> torch.Tensor:
    """The processed logits (float32 for processed rows; ``logits`` itself when no row asks)."""
    rows = [b for b, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return logits
    out = logits.float().clone()
    _, t, vocab = logits.shape
    for b in rows:
        out[b] = _row(out[b], seqs[b], drafts[b, : t - 1], vocab)
    return out


def _row(x: torch.Tensor, seq: Sequence, drafts: torch.Tensor, vocab: int) -> torch.Tensor:
    """``x`` [t, vocab]: one row's logits; position i has seen the output and d_1..d_i."""
    p, dev, t = seq.params, x.device, x.shape[0]
    out_ids = to_device(seq.output_ids, torch.long, dev)
    # [vocab] token counts (not bincount: on CUDA it reads the max id back, a sync)
    base = torch.zeros(vocab, device=dev).index_add_(
        0, out_ids, torch.ones_like(out_ids, dtype=torch.float32)
    )
    step = torch.zeros(t, vocab, device=dev)  # [t, vocab]: row i counts d_i (row 0: nothing)
    if t > 1:
        step[1:].scatter_(-1, drafts[:, None].to(dev), 1.0)
    counts = base[None] + step.cumsum(0)  # [t, vocab]
    if p.repetition_penalty != 1.0:
        prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
        prompt[to_device(seq.prompt_ids, torch.long, dev)] = True
        seen = (counts > 0) | prompt[None]
        r = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    x = x - counts * p.frequency_penalty - (counts > 0).float() * p.presence_penalty
    if p.logit_bias:
        ids = to_device([i for i, _ in p.logit_bias], torch.long, dev)
        x[:, ids] += to_device([float(v) for _, v in p.logit_bias], torch.float32, dev)
    return x
