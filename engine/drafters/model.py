"""A draft model: any causal LM with the target's vocabulary, run over its own slot KV cache.

Cache bookkeeping (the draft cache holds positions [0, draft_len) of the sequence):
  * ``add`` prefills the whole prompt (the prompts admitted together in one ragged forward).
  * ``propose`` first feeds the tokens the draft has not seen (the last emitted token, plus the
    last drafted token and the bonus token after an all-accepted round), samples d_1, then feeds
    d_1..d_{K-1} one at a time. d_K is never fed.
  * ``commit`` rolls the draft cache back to the prefix that agrees with the new sequence:
    ``min(draft_len, len(tokens) - 1)``. After an all-accepted round that leaves d_K and the bonus
    token unseen; the next ``propose`` takes them in (the catch-up feed).
The same class serves the target itself as its own draft and its first N layers ("early exit").
"""

from __future__ import annotations

import torch

from engine.drafters.base import DrafterBase, Proposal
from engine.drafters.chain import Position, RowParams, draft_chain
from engine.model.runner import ModelRunner
from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence
from engine.sampling.grammar import DraftGrammar
from engine.sampling.probs import logits_to_probs, race

ADD_TOKENS = 2048  # the most padded prompt tokens one admission forward of the draft model takes


class TokenizerMismatchError(ValueError):
    pass


def check_same_vocab(target_tok, draft_tok) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise TokenizerMismatchError(
            "the draft model's tokenizer differs from the target's: a draft model must share the "
            "target's vocabulary (use the n-gram drafter, or a draft model of the same family)"
        )


class ModelDrafter(DrafterBase):
    samples = True
    runner: ModelRunner

    def __init__(self, runner: ModelRunner, vocab_size: int, name: str = "draft_model"):
        self.runner, self.vocab_size, self.name = runner, vocab_size, name

    @property
    def cache(self):
        return self.runner.cache

    def add(self, seqs: list[Sequence], lazy: bool = False) -> None:
        """Prefill the draft model with the new prompts, several to one ragged forward while
        their padded size fits ``ADD_TOKENS`` (one eager forward costs about the same for 1 or
        4 short prompts on a GPU); a request with speculation off never drafts (its K cap is 0),
        so it costs no draft prefill and holds no draft slot."""
        group: list[Sequence] = []
        for s in (s for s in seqs if s.spec.enabled):
            self.cache.allocate(s.slot)
            widest = max([len(g.prefill_ids) for g in group] + [len(s.prefill_ids)])
            if group and widest * (len(group) + 1) > ADD_TOKENS:
                self._prefill(group)
                group = []
            group.append(s)
        if group:
            self._prefill(group)

    def _prefill(self, seqs: list[Sequence]) -> None:
        self.runner.forward([s.prefill_ids for s in seqs], [s.slot for s in seqs])
        for s in seqs:
            self.cache.commit(s.slot, len(s.prefill_ids))

    def remove(self, seq: Sequence) -> None:
        self.cache.free(seq.slot)

    def backlogs(self, seqs: list[Sequence]) -> list[int]:
        """The catch-up feed beyond one token: no bound, every token the draft model missed."""
        return [max(s.num_tokens - self.cache.lengths[s.slot] - 1, 0) for s in seqs]

    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        """Feed each row what the draft model has not seen (its catch-up) and draft d_1 from the
        last position, then feed each draft to draft the next (:func:`draft_chain`). d_K is never
        fed; commit() trims the cache to the prefix the round kept."""
        cache, noise = self.cache, plan.draft_noise

        def step(at: Position, _: None) -> tuple[torch.Tensor, None]:
            slots = [seqs[b].slot for b in at.rows]
            if at.prev is None:  # the catch-up: every token past the draft's cache
                feed = [
                    seqs[b].token_array()[cache.lengths[s] :].tolist()
                    for b, s in zip(at.rows, slots)
                ]
                counts = [len(f) for f in feed]
                logits = self.runner.forward(feed, slots).logits  # [rows, vocab']
            else:  # the previous draft, one token a row
                counts = [1] * len(slots)
                logits = self.runner.forward(at.prev[:, None], slots, counts).logits
            for s, n in zip(slots, counts):
                cache.commit(s, cache.lengths[s] + n)
            return logits[:, : self.vocab_size], None  # [rows, vocab]

        def choose(logits, rows, row_t, j, p: RowParams, guide: DraftGrammar):
            logits = guide.mask(logits, rows)  # grammar rows: what the grammar allows next
            q = logits_to_probs(logits[:, None], p.temperature, p.top_k, p.top_p, plan.filter_rows)
            q = q[:, 0]  # [rows, vocab]
            if noise is None:
                return q.argmax(-1), q
            return torch.where(p.greedy, q.argmax(-1), race(q, noise[row_t, j])), q

        # q is reported when a row samples (draft noise planned); an all-greedy batch: none
        return draft_chain(seqs, plan, self.vocab_size, noise is not None, step, choose)

    def commit(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.cache.rollback(s.slot, min(self.cache.lengths[s.slot], s.num_tokens - 1))
