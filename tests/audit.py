"""Structural checks of every speculative round, with no statistics: what a sampled round hands
the acceptance rule is checked against what it should be, row by row, position by position.

For every row of a round that samples (temperature > 0) and drafted n > 0 tokens:
  * the draft: each drafted token d_j is the one the reported draft distribution q_j and the
    row's draft noise select (the exponential race argmax(q_j / E_j) a sampling drafter runs;
    a deterministic drafter's q is one-hot at d_j, or None), and q_j is a distribution with
    q_j(d_j) > 0. A drafter that samples from one distribution but reports another (the rule
    would then divide by the wrong q) fails here.
  * the target: the p the rule gets at each verified position j = 0..n equals an independent
    computation of the processed target distribution after the row's tokens and d_1..d_j: the
    reference's logits of the whole context in one forward (no KV cache, no verify), then
    temperature, top-k and top-p written here in float64. A verify at the wrong temperature, a
    position or cache off by one, or a rolled-back cache that kept a rejected token fails here.
Greedy rows: the argmax of what the rule gets equals the reference's argmax.

Rows with penalties, a logit bias, a grammar, allowed tokens, bad words or min_tokens are
processed beyond what the reference knows (min_p it knows): their p is not checked (counted in
``skipped``); a grammar's forced run reports a one-hot q.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# (a row's context, n) -> the logits of the next token after each of the context's last n + 1
# prefixes, [n + 1, vocab] (any float dtype): one forward over the whole context
Reference = Callable[[list[int], int], torch.Tensor]


def hf_reference(model) -> Reference:
    """A transformers causal LM's own forward over the whole context (no cache)."""

    @torch.no_grad()
    def ref(ids: list[int], n: int) -> torch.Tensor:
        x = torch.tensor([ids], device=model.device)
        return model(x).logits[0, -(n + 1) :].double().cpu()

    return ref


def runner_reference(runner) -> Reference:
    """A model runner's eager forward over the whole context, as a prefill into a scratch slot
    (the 4-bit target: the same weights, none of the verify's path)."""

    @torch.no_grad()
    def ref(ids: list[int], n: int) -> torch.Tensor:
        slot = runner.cache.allocate()
        try:
            with runner.eager():  # the eager path only
                logits = runner.forward([ids], [slot], logits="all").logits
            return logits[0, -(n + 1) :].double().cpu()
        finally:
            runner.cache.free(slot)

    return ref


def processed(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Temperature, then min-p (tokens less probable than min_p x the most probable one out),
    then top-k, then top-p (the smallest set of most probable tokens whose mass reaches top_p;
    ties at the boundary kept), in float64: [vocab] -> [vocab]."""
    z = logits.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p > 0:
        keep &= torch.softmax(z, -1) >= min_p * torch.softmax(z, -1).max()
        z = z.masked_fill(~keep, float("-inf"))
    if 0 < top_k < z.numel():
        keep &= z >= z.topk(top_k).values[-1]
    p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)
    if top_p < 1:
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]
        drop = torch.zeros_like(keep)
        drop[order] = before >= top_p
        p = p.masked_fill(drop, 0.0)
    return p / p.sum()


@dataclass
class RoundAudit:
    """Attach to a :class:`~engine.engine.SpecEngine`; every round's acceptance call is checked
    (module doc). ``atol``: the largest difference allowed between the verify's p and the
    reference's (float32 rounding). Counters say what was checked; a test asserts they are > 0
    so that the audit itself cannot pass by checking nothing."""

    engine: object
    reference: Reference
    atol: float = 1e-4
    rounds: int = 0
    drafts_checked: int = 0  # drafted tokens whose q and noise were checked
    positions_checked: int = 0  # verified positions whose p was checked against the reference
    greedy_checked: int = 0
    skipped: int = 0  # rows processed beyond the reference (penalties, bias, grammar)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self):
        spec = self.engine.speculator
        self._plan_fn, self._accept, self._round = spec._plan, spec.accept, spec.round
        self._seqs: list = []
        self._tokens: list[list[int]] = []
        self._plan = None
        self._worst = 0.0
        spec._plan = self._plan_hook
        spec.accept = self._accept_hook
        spec.round = self._round_hook

    def _round_hook(self, seqs, *rest):
        self._seqs, self._tokens = list(seqs), [s.tokens for s in seqs]
        return self._round(seqs, *rest)

    def _plan_hook(self, seqs, ks):
        self._plan = self._plan_fn(seqs, ks)
        return self._plan

    def _accept_hook(self, probs, drafts, num, draft_probs, greedy, uniforms, noise):
        self.rounds += 1
        self._check(probs, drafts, num.tolist(), draft_probs)
        return self._accept(probs, drafts, num, draft_probs, greedy, uniforms, noise)

    def _check(self, probs, drafts, num, draft_probs) -> None:
        plan = self._plan
        assert plan is not None
        host = drafts.tolist()
        for b, (s, ctx, n) in enumerate(zip(self._seqs, self._tokens, num)):
            prm = s.params
            if prm.greedy:
                want = self.reference(ctx + host[b][:n], n).argmax(-1)
                got = probs[b, : n + 1].argmax(-1).cpu()
                self.greedy_checked += n + 1
                if not torch.equal(got, want):
                    self.failures.append(f"round {self.rounds} row {b}: argmax {got} != {want}")
                continue
            if n:
                self._check_drafts(b, host[b][:n], draft_probs, plan.draft_noise)
            if (
                prm.penalized
                or prm.grammar is not None
                or prm.min_tokens
                or prm.allowed_token_ids is not None
                or prm.bad_words
            ):
                self.skipped += 1
                continue
            ref = self.reference(ctx + host[b][:n], n)
            for j in range(n + 1):
                want = processed(ref[j], prm.temperature, prm.top_k, prm.top_p, prm.min_p)
                got = probs[b, j].double().cpu()
                err = (got - want).abs().max().item()
                self._worst = max(self._worst, err)
                self.positions_checked += 1
                if err > self.atol:
                    self.failures.append(
                        f"round {self.rounds} row {b} position {j}: |p - reference| = {err:.3g}"
                    )

    def _check_drafts(self, b, tokens, draft_probs, draft_noise) -> None:
        for j, d in enumerate(tokens):
            self.drafts_checked += 1
            where = f"round {self.rounds} row {b} draft {j}"
            if draft_probs is None:  # a deterministic drafter: one-hot q, nothing sampled
                continue
            q = draft_probs[b, j].double().cpu()
            if q.min() < 0 or abs(q.sum().item() - 1) > 1e-4 or q[d] <= 0:
                self.failures.append(f"{where}: q is not a distribution with q(d) > 0")
                continue
            if q.max() == 1.0:  # one-hot (an n-gram copy beside a sampling head): q selects d
                if q[d] != 1.0:
                    self.failures.append(f"{where}: one-hot q at {q.argmax()} but drafted {d}")
                continue
            if draft_noise is None:
                self.failures.append(f"{where}: a sampled q with no draft noise planned")
                continue
            pick = int((q / draft_noise[b, j].double().cpu()).argmax())
            if pick != d:
                self.failures.append(f"{where}: q and the noise select {pick}, drafted {d}")

    def worst(self) -> float:
        """The largest |p - reference| seen (0 when every position matched to the bit)."""
        return self._worst

    def assert_clean(self, sampled: bool = True) -> None:
        """No check failed, and the audit checked something of each kind it was there for."""
        assert not self.failures, self.failures[:10]
        assert self.rounds > 0, "no round was audited"
        if sampled:
            assert self.drafts_checked > 0 and self.positions_checked > 0, (
                self.drafts_checked,
                self.positions_checked,
            )
