"""vLLM's sampling rules, applied to the target's processed logits at every verified position
after bias, penalties (penalties.py) and the grammar mask (grammar.py), before temperature /
top-k / top-p (sampling/probs.py), in vLLM's order:

  * ``allowed_token_ids``: every other token gets probability 0.
  * ``min_tokens``: while the output (with the drafts before the position) holds fewer than
    ``min_tokens`` tokens, the row's stop tokens (``stop_token_ids``, and EOS unless
    ``ignore_eos``) get probability 0 -- unless nothing else is left (a grammar that allows
    only the end): then the position is left as it was, as a stop is the only way out.
  * ``min_p`` (sampled rows): a token whose probability after temperature is below
    ``min_p`` times the most probable one's gets probability 0. In logits that is
    ``l < max(l) + T * ln(min_p)``, so it is applied here, before the division by T. A greedy
    row's argmax never falls below it, so greedy rows skip it.

Exactness under speculation, as for penalties: position i of a row (the token after d_1..d_i)
counts d_1..d_i as output, so each position is processed exactly as plain decoding would have
processed it had those drafts been emitted; the rejection rule therefore emits tokens distributed
as the processed target's, and greedy output equals processed greedy decoding. ``allowed_token_ids``
and ``min_p`` read no drafts (a draft tree may verify them); ``min_tokens`` counts a chain's
drafts, so a row still short of it verifies chains (kcontrol/controller.py ``may_grow``). Rows
without a rule are untouched: the round pays nothing for them.
"""

from __future__ import annotations

import math

import torch

from engine.records.sequence import Sequence
from engine.transfer import to_device


def apply_rules(
    logits: torch.Tensor,  # [batch, t, vocab] the processed logits at each verified position
    seqs: list[Sequence],
    eos_token_ids: tuple[int, ...],
) -> torch.Tensor:
    """The logits with each row's rules applied (float32 for ruled rows; ``logits`` itself when
    no row has a rule)."""
    rows = [b for b, s in enumerate(seqs) if s.params.ruled]
    if not rows:
        return logits
    out = logits.float().clone()
    for b in rows:
        out[b] = _row(out[b], seqs[b], eos_token_ids)
    return out


def stop_ids(seq: Sequence, eos_token_ids: tuple[int, ...]) -> list[int]:
    """The tokens that end ``seq``'s output (requests/scheduler.py ``postprocess``)."""
    p = seq.params
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))


def _row(x: torch.Tensor, seq: Sequence, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``x`` [t, vocab]: one row's logits; position i has seen the output and d_1..d_i."""
    p, dev = seq.params, x.device
    t, vocab = x.shape
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[to_device([i for i in p.allowed_token_ids if i < vocab], torch.long, dev)] = True
        x = x.masked_fill(~keep, float("-inf"))
    short = min(p.min_tokens - len(seq.output_ids), t)  # positions that may not stop
    ids = [i for i in stop_ids(seq, eos_token_ids) if i < vocab]
    if short > 0 and ids:
        head = x[:short].clone()
        head[:, to_device(ids, torch.long, dev)] = float("-inf")
        left = (head > float("-inf")).any(-1, keepdim=True)  # [short, 1]
        x = torch.cat([torch.where(left, head, x[:short]), x[short:]])
    if p.min_p > 0 and not p.greedy:
        floor = x.max(-1, keepdim=True).values + p.temperature * math.log(p.min_p)
        x = x.masked_fill(x < floor, float("-inf"))
    return x
