"""N-gram prompt lookup: no model, drafts by copying what followed the last n tokens earlier in
the prompt + output (longest n first). Deterministic, so its q is one-hot."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from engine.drafters.base import DrafterBase, Proposal
from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence
from engine.transfer import to_device


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram (max_n down to min_n) of ``tokens``; a match with a full k-token continuation is
    preferred to a more recent, shorter one."""
    return ngram_match(tokens, k, min_n, max_n)[1]


def ngram_match(
    tokens: np.ndarray, k: int, min_n: int = 1, max_n: int = 3
) -> tuple[int, list[int]]:
    """:func:`ngram_lookup`'s draft with the length n of the suffix it matched (0, [] if none)."""
    length = len(tokens)
    if k <= 0:
        return 0, []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # [length - n, n]: every earlier n-gram
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size == 0:
            continue
        starts = hits + n  # where each match's continuation begins
        full = starts[starts + k <= length]
        start = int(full[-1]) if full.size else int(starts[0])
        return n, tokens[start : start + k].tolist()
    return 0, []


def grammar_prefix(seqs: list[Sequence], drafts: list[list[int]]) -> list[list[int]]:
    """Each grammar row's draft cut to the prefix its grammar allows (exact: q stays one-hot)."""
    return [
        d[: s.matcher.validate_tokens(d)] if s.matcher is not None and d else d
        for s, d in zip(seqs, drafts)
    ]


class NgramDrafter(DrafterBase):
    name = "ngram"
    samples = False

    def steps(self, width: int) -> int:
        return 1 if width > 0 else 0  # one lookup, whatever the length

    def __init__(self, device: torch.device | str = "cpu", min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= ngram min_n <= max_n")
        self.device, self.min_n, self.max_n = torch.device(device), min_n, max_n

    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        ks = plan.ks
        drafts = [
            ngram_lookup(s.token_array(), k, self.min_n, self.max_n) if k > 0 else []
            for s, k in zip(seqs, ks)
        ]
        drafts = grammar_prefix(seqs, drafts)
        width = max([len(d) for d in drafts] + [0])
        padded = [d + [0] * (width - len(d)) for d in drafts]
        tokens = to_device(padded, torch.long, self.device).reshape(len(seqs), width)
        num = [len(d) for d in drafts]
        return Proposal(tokens=tokens, num=num, probs=None, copied=[n > 0 for n in num])
