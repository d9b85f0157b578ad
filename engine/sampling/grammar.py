"""Grammar-constrained decoding (structured outputs) under speculation, with llguidance.

A request with ``SamplingParams.grammar`` (an llguidance grammar: JSON schema, Lark, regex)
gets a matcher, owned by its :class:`~engine.records.sequence.Sequence`, that always stands at the
sequence's committed output. In a round:

  * verify: for verified position i (after the drafts d_1..d_i) the row's logits are masked to
    the tokens the grammar allows after ``output + d_1..d_i``: the matcher consumes the drafts
    one by one, a mask is filled at each position, then the matcher rolls back. A draft the
    grammar refuses ends the row's masks: the target gives it probability 0, so the rejection
    rule rejects it for certain and no later position is ever used.
  * commit: the matcher consumes the emitted tokens (every one is allowed: an accepted draft had
    nonzero masked probability, a recovered or bonus token is drawn from the masked p).

So every emitted token is sampled exactly from the masked (processed) target distribution, with
or without speculation, for any drafter and any draft distribution. For acceptance, drafters
that draft step by step draw from the masked q (:class:`DraftGrammar`) and the n-gram drafter
proposes only the prefix the grammar allows. The masks are computed on the host (llguidance,
cheap beside a forward: docs/measurements.md) and need the drafted ids on the host.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.records.sequence import Sequence
from engine.transfer import to_device


class GrammarCompiler:
    """Matchers for grammars over one tokenizer. llguidance reads the tokenizer's vocabulary
    once, at the first grammar (so servers that never see one never pay for it); the result is
    read-only, so the HTTP thread's checks and the engine share one compiler."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, self.vocab_size)
        return self._tokenizer

    def check(self, grammar: str) -> str | None:
        """Why ``grammar`` cannot be used (None: it can)."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return error or None

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher at the start of ``grammar``; ValueError if it does not compile."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=1)
        if m.is_error():
            raise ValueError(m.get_error())
        return m


def apply_grammar(
    logits: torch.Tensor,  # [batch, k+1, vocab] processed logits at each verified position
    seqs: list[Sequence],
    drafts: list[list[int]],  # each row's drafts d_1..d_K_i (host ints)
) -> torch.Tensor:
    """``logits`` with each grammar row masked position by position (``-inf`` where the
    grammar refuses); ``logits`` itself when no row has a grammar."""
    rows = [b for b, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return logits
    import llguidance.torch as llt

    _, t, vocab = logits.shape
    bits = llt.allocate_token_bitmask(len(rows) * t, vocab)  # [rows * t, words]
    for r, b in enumerate(rows):
        m = seqs[b].matcher
        consumed = 0
        for i in range(t):
            llt.fill_next_token_bitmask(m, bits, r * t + i)
            if i == t - 1 or i >= len(drafts[b]) or not _allows(bits[r * t + i], drafts[b][i]):
                break  # positions past here are never used: they keep this mask
            # a finished grammar takes nothing more, not even the EOS its mask allows (feeding
            # it one errs the matcher for good): the positions after keep the EOS-only mask
            if m.is_stopped() or not m.consume_tokens([drafts[b][i]]):
                break
            consumed += 1
        for j in range(i + 1, t):
            bits[r * t + j] = bits[r * t + i]
        m.rollback(consumed)
    out = logits.float().clone()
    allowed = to_device(unpack(bits, vocab), None, out.device).view(len(rows), t, vocab)
    idx = to_device(rows, torch.long, out.device)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


class DraftGrammar:
    """The grammar rows of one proposal, for a drafter that drafts step by step: each step's
    logits are masked to what the grammar allows after the tokens drafted so far (so the draft
    distribution q it reports is the masked one, and it never drafts a refused token), and the
    matchers roll back when the proposal is done (:meth:`close`). At a step where a row's
    allowed tokens all lie outside the drafter's support, the row keeps its unmasked q and its
    matcher does not take the draft (the target gives that draft probability 0, so it and every
    later draft of the row are rejected, whatever masks the later steps get)."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs
        self.consumed = {b: 0 for b, s in enumerate(seqs) if s.matcher is not None}
        self.masks: dict[int, torch.Tensor] = {}  # row -> its mask at this step [words]

    def __bool__(self) -> bool:
        return bool(self.consumed)

    def mask(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``logits`` [len(rows), vocab] of batch rows ``rows`` at this drafting step."""
        self.masks = {}
        sel = [i for i, b in enumerate(rows) if b in self.consumed]
        if not sel:
            return logits
        import llguidance.torch as llt

        bits = llt.allocate_token_bitmask(len(sel), logits.shape[-1])  # [sel, words]
        for n, i in enumerate(sel):
            llt.fill_next_token_bitmask(self.seqs[rows[i]].matcher, bits, n)
        out = logits.float().clone()
        allowed = to_device(unpack(bits, logits.shape[-1]), None, out.device)  # [sel, vocab]
        sub = out[to_device(sel, torch.long, out.device)].masked_fill(~allowed, float("-inf"))
        keep = torch.isfinite(sub).any(-1).tolist()  # some allowed token has support
        for n, i in enumerate(sel):
            if keep[n]:
                out[i] = sub[n]
                self.masks[rows[i]] = bits[n]
        return out

    def took(self, tokens: list[int], rows: list[int]) -> None:
        """The step drafted ``tokens`` (host ints) for ``rows``: masked rows' matchers take
        them (always allowed: they were drawn from the masked q)."""
        for tok, b in zip(tokens, rows):
            m = self.seqs[b].matcher
            # a finished grammar takes nothing more (the EOS after it would err the matcher)
            ok = b in self.masks and _allows(self.masks[b], tok) and not m.is_stopped()
            if ok and m.consume_tokens([tok]):
                self.consumed[b] += 1

    def close(self) -> None:
        for b, n in self.consumed.items():
            self.seqs[b].matcher.rollback(n)
        self.consumed, self.masks = {}, {}


_BITS = torch.arange(32, dtype=torch.int32)


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's bitmask ``[rows, words]`` int32 (bit i of word w: token 32 w + i allowed)
    as a bool mask ``[rows, vocab]`` (llguidance's own CPU apply is far slower:
    docs/measurements.md)."""
    return ((bits[:, :, None] >> _BITS) & 1).bool().flatten(1)[:, :vocab]


def _allows(mask: torch.Tensor, token: int) -> bool:
    """Whether the bitmask row ``mask`` ([words] int32) allows ``token``."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def advance(seq: Sequence, tokens: list[int]) -> None:
    """The matcher consumes the tokens the sequence just emitted."""
    m = seq.matcher
    if m is None or not tokens or m.is_stopped():  # stopped: only the EOS that ends it follows
        return
    if not m.consume_tokens(tokens):
        raise RuntimeError(f"grammar refused an emitted token: {m.get_error()}")
