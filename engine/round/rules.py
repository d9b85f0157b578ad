"""vLLM's sampling rules, applied to the target's processed logits at every verified position
after bias, penalties (penalties.py) and the grammar mask (grammar.py), before temperature /
top-k / top-p (sampling/probs.py), in vLLM's order:

  * ``allowed_token_ids``: every other token gets probability 0.
  * ``bad_words`` (token sequences): a word's last token gets probability 0 where the output
    ends with the rest of the word (a one-token word: everywhere) -- vLLM's rule, which reads
    the output only, not the prompt. Should that leave nothing (with allowed_token_ids), the
    position is left as it was before the bad words.
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
as the processed target's, and greedy output equals processed greedy decoding.
``allowed_token_ids``, ``min_p`` and one-token bad words read no drafts (a draft tree may verify
them); ``min_tokens`` counts a chain's drafts and a longer bad word matches its start against
them, so such a row verifies chains (kcontrol/controller.py ``may_grow``). Rows without a rule
are untouched: the round pays nothing for them.
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
    drafts: torch.Tensor | None = None,  # [batch, >= t-1] long: the chains d_1..d_K verified
) -> torch.Tensor:
    """The logits with each row's rules applied (float32 for ruled rows; ``logits`` itself when
    no row has a rule). ``drafts`` is needed where a row has a bad word of several tokens and
    t > 1."""
    rows = [b for b, s in enumerate(seqs) if s.params.ruled]
    if not rows:
        return logits
    out = logits.float().clone()
    t = logits.shape[1]
    for b in rows:
        chain: list[int] = []
        if t > 1 and seqs[b].params.multi_token_bad_words:  # (a host read: such rows only)
            assert drafts is not None, "a multi-token bad word reads the drafts"
            chain = drafts[b, : t - 1].tolist()
        out[b] = _row(out[b], seqs[b], eos_token_ids, chain)
    return out


def bad_word_bans(seq: Sequence, chain: list[int], t: int) -> list[list[int]]:
    """Per verified position i (< t) the tokens the bad words ban there: the output so far with
    d_1..d_i after it must end with a word's other tokens for its last to be banned."""
    words = seq.params.bad_words
    longest = max(len(w) for w in words) - 1
    # the output's last tokens a word can reach back to, then the drafts
    out = seq.output_ids
    tail = list(out[max(0, len(out) - longest) :] if longest else []) + chain
    base = len(tail) - len(chain)
    bans: list[list[int]] = []
    for i in range(t):
        past = tail[: base + i]
        bans.append(
            [
                w[-1]
                for w in words
                if len(w) - 1 <= len(out) + i
                and (len(w) == 1 or past[len(past) - (len(w) - 1) :] == list(w[:-1]))
            ]
        )
    return bans


def stop_ids(seq: Sequence, eos_token_ids: tuple[int, ...]) -> list[int]:
    """The tokens that end ``seq``'s output (requests/scheduler.py ``postprocess``)."""
    p = seq.params
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))


def _row(
    x: torch.Tensor, seq: Sequence, eos_token_ids: tuple[int, ...], chain: list[int]
) -> torch.Tensor:
    """``x`` [t, vocab]: one row's logits; position i has seen the output and d_1..d_i
    (``chain``: d_1..d_{t-1}, where a bad word reads them)."""
    p, dev = seq.params, x.device
    t, vocab = x.shape
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool, device=dev)
        keep[to_device([i for i in p.allowed_token_ids if i < vocab], torch.long, dev)] = True
        x = x.masked_fill(~keep, float("-inf"))
    if p.bad_words:
        at = [
            (i, j) for i, ids in enumerate(bad_word_bans(seq, chain, t)) for j in ids if j < vocab
        ]
        ban = torch.zeros(t, vocab, dtype=torch.bool, device=dev)
        if at:  # (the positions and tokens to the device as indices, not a [t, vocab] mask)
            rows, cols = (to_device(list(c), torch.long, dev) for c in zip(*at))
            ban[rows, cols] = True
        banned = x.masked_fill(ban, float("-inf"))
        left = (banned > float("-inf")).any(-1, keepdim=True)  # [t, 1]
        x = torch.where(left, banned, x)
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
