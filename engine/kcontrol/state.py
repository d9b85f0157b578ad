"""A request's own speculation record: its acceptance rate α and match rate m, no policy.

α is the probability that a drafted token is accepted given that every drafted token before it in
the round was; m is the fraction of rounds with K > 0 in which the drafter proposed anything (an
n-gram lookup without a match drafts nothing).

Estimates: exponentially weighted counts over the request's own rounds. A round that drafted n
tokens and accepted a adds a successes and, when a < n, one failure (the maximum-likelihood
estimate of a geometric run), after decaying the old counts by ``decay`` per drafted token (a
memory of about 1 / (1 - decay) drafted tokens, whatever K was):
    α = (S + α0·w0) / (S + F + w0),
with a weak prior α0 of weight w0. m likewise, per round, over the rounds in which the row asked
for K > 0. Both estimates stay in (0, 1).

A round at K = 0 observes nothing, but it ages S and F by ``IDLE_DECAY``, so α drifts back
towards the prior. Without that, a row stopped drafting where a dip of its estimate crossed
break-even, and its estimate stayed frozen at that dip until a probe, tens of rounds later, so
the adaptive K saw a lower α than a fixed K did on the same prompts. With aging, the
EAGLE-3 head and the n-gram drafter both ran faster one request at a time than without it, and
a batch that stays plain ran as before (docs/measurements.md). The cost: a row at α ≈ 0 now
drafts a token now and then; where a verified token is cheap (GPU-like) that costs a few per
cent of plain decoding at most in simulation (tests/engine/kcontrol/test_k_control.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# prior of a new request's acceptance rate and match rate, and their weights in tokens / rounds
ALPHA_PRIOR, ALPHA_PRIOR_WEIGHT = 0.5, 1.0
MATCH_PRIOR, MATCH_PRIOR_WEIGHT = 0.5, 1.0
IDLE_DECAY = 0.85  # a K = 0 round keeps this much of a row's acceptance evidence


@dataclass
class KState:
    """A request's own speculation history, kept on its Sequence and updated by the controller."""

    acc: float = 0.0  # decayed accepted drafted tokens
    rej: float = 0.0  # decayed rejection events
    matched: float = 0.0  # decayed rounds with K > 0 in which the drafter proposed something
    asked: float = 0.0  # decayed rounds with K > 0
    heuristic_k: int | None = None  # HeuristicK's current K
    backlog: int = 0  # positions beyond one the drafter would take in first (set after commit)

    @property
    def alpha(self) -> float:
        return (self.acc + ALPHA_PRIOR * ALPHA_PRIOR_WEIGHT) / (
            self.acc + self.rej + ALPHA_PRIOR_WEIGHT
        )

    @property
    def match(self) -> float:
        return (self.matched + MATCH_PRIOR * MATCH_PRIOR_WEIGHT) / (self.asked + MATCH_PRIOR_WEIGHT)

    def update(self, asked_k: int, drafted: int, accepted: int, decay: float) -> None:
        """Record one round that asked for ``asked_k`` tokens, got ``drafted`` from the drafter
        and had ``accepted`` of them accepted (0 <= accepted <= drafted)."""
        if asked_k <= 0:  # nothing observed; the evidence ages (IDLE_DECAY a round)
            self.acc, self.rej = IDLE_DECAY * self.acc, IDLE_DECAY * self.rej
            return
        self.matched = decay * self.matched + (drafted > 0)
        self.asked = decay * self.asked + 1.0
        if drafted > 0:
            forget = decay**drafted  # per drafted token: a round of 8 weighs like 8 rounds of 1
            self.acc = forget * self.acc + accepted
            self.rej = forget * self.rej + (accepted < drafted)
