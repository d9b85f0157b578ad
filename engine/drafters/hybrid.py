"""EAGLE-3 with a per-row copying fallback: where a row's text repeats, copy; else the head.

Each round, for every row that may draft (K > 0), the n-gram lookup (drafters/ngram.py) looks
for the row's last ``min_match``..``max_n`` tokens earlier in its prompt + output. A row with
such a match drafts the tokens that followed it, with a one-hot q (a deterministic draft); every
other row is drafted by the EAGLE-3 head with its own q (drafters/eagle/drafter.py). Both are
exact in the rejection rule, so the output stays the target's whatever each row takes.

The head keeps every row's state in step either way: a row drafted by n-gram leaves its target
features pending, and the head takes them in the next time it drafts for that row (its
``commit`` already drops whatever a verify rejected). ``min_match`` sets how strong a repeat
must be before copying beats the head: a one-token match is nearly always there and rarely right.

With a suffix drafter (drafters/suffix.py) as the copier instead, a row copies the suffix
draft where its match, in the row's own text or in recent requests' outputs, is at least
``min_match`` tokens long; the suffix drafter follows every row's committed tokens either way
(its ``add`` / ``commit`` / ``remove``), so its indexes stay whole whoever drafts.
"""

from __future__ import annotations

from dataclasses import replace

from engine.drafters.base import DrafterBase, Proposal
from engine.drafters.eagle.drafter import EagleDrafter
from engine.drafters.forced import with_forced
from engine.drafters.ngram import grammar_prefix, ngram_match
from engine.drafters.suffix import SuffixDrafter
from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence


class HybridDrafter(DrafterBase):
    name = "eagle3+ngram"
    samples = True  # the head's rows sample
    trees = True  # the head's rows

    def __init__(
        self,
        eagle: EagleDrafter,
        min_match: int = 3,
        max_n: int = 4,
        suffix: SuffixDrafter | None = None,
    ):
        """``suffix``: copy its drafts (matches of ``min_match`` tokens or more) instead of the
        n-gram lookup's (``max_n`` then unused)."""
        if suffix is None and not 1 <= min_match <= max_n:
            raise ValueError("need 1 <= ngram_fallback <= ngram_max")
        if suffix is not None and min_match < 1:
            raise ValueError("need suffix_fallback >= 1")
        self.eagle, self.min_match, self.max_n = eagle, min_match, max_n
        self.suffix = suffix
        if suffix is not None:
            self.name = "eagle3+suffix"
        self.taps = eagle.taps
        self.copied = 0  # rows drafted by the n-gram lookup, for tests and benchmarks
        self.headed = 0  # rows drafted by the head
        self.last_copied: list[int] = []  # the last proposal's copied rows

    # the head's state follows every row, whoever drafts it
    def observe(self, seqs, hidden, starts, counts) -> None:
        self.eagle.observe(seqs, hidden, starts, counts)

    def add(self, seqs: list[Sequence], lazy: bool = False) -> None:
        self.eagle.add(seqs, lazy)
        if self.suffix is not None:
            self.suffix.add(seqs, lazy)

    def fork(self, src: Sequence, dst: Sequence) -> None:
        self.eagle.fork(src, dst)

    def commit(self, seqs: list[Sequence]) -> None:
        self.eagle.commit(seqs)
        if self.suffix is not None:
            self.suffix.commit(seqs)

    def remove(self, seq: Sequence) -> None:
        self.eagle.remove(seq)
        if self.suffix is not None:
            self.suffix.remove(seq)

    def warm_up(self) -> None:
        self.eagle.warm_up()

    def own_path(self) -> str | None:
        return self.eagle.own_path()

    def backlogs(self, seqs: list[Sequence]) -> list[int]:
        return self.eagle.backlogs(seqs)

    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        ks = list(plan.ks)
        copies = grammar_prefix(seqs, [self.copy(s, k) for s, k in zip(seqs, ks)])
        head_ks = [0 if c else k for c, k in zip(copies, ks)]
        self.last_copied = [b for b, c in enumerate(copies) if c]
        self.copied += len(self.last_copied)
        self.headed += sum(1 for k in head_ks if k > 0)
        prop = self.eagle.propose(seqs, replace(plan, ks=head_ks))
        # a copied row was asked for nothing: its copy goes in as a one-hot run, like a forced one
        tokens, num, probs = with_forced(prop.tokens, prop.num, prop.probs, copies)
        # a copied row has no alternatives
        copied = [bool(c) for c in copies]
        return Proposal(tokens, num, probs, prop.alternatives, prop.extra_rows, copied)

    def copy(self, seq: Sequence, k: int) -> list[int]:
        """Row ``seq``'s copy of at most ``k`` tokens, or [] where the head should draft."""
        if k <= 0:
            return []
        if self.suffix is None:
            return ngram_match(seq.token_array(), k, self.min_match, self.max_n)[1]
        draft, source = self.suffix.draft(seq, k)
        if draft.match < self.min_match:
            return []
        self.suffix.own_drafts += source == "own"
        self.suffix.shared_drafts += source == "shared"
        return draft.tokens
