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
# a draft tree's leaves (engine/round/draft_tree.py): the chance β that a round whose chain was
# cut short ends at a leaf instead, per unit of leaf_reach(L) (the prior and its weight, rounds)
LEAF_PRIOR, LEAF_PRIOR_WEIGHT = 0.2, 2.0
LEAF_DECAY = 0.5  # the L-th leaf adds LEAF_DECAY^(L-1) to L-1's reach: the best go first


def leaf_reach(leaves):
    """Σ_{l<L} LEAF_DECAY^l: how far L leaves reach, in units of the first's (array or scalar)."""
    return (1.0 - LEAF_DECAY**leaves) / (1.0 - LEAF_DECAY)


@dataclass
class KState:
    """A request's own speculation history, kept on its Sequence and updated by the controller."""

    acc: float = 0.0  # decayed accepted drafted tokens
    rej: float = 0.0  # decayed rejection events
    matched: float = 0.0  # decayed rounds with K > 0 in which the drafter proposed something
    asked: float = 0.0  # decayed rounds with K > 0
    heuristic_k: int | None = None  # HeuristicK's current K
    backlog: int = 0  # positions beyond one the drafter would take in first (set after commit)
    leaf_hits: float = 0.0  # decayed rounds cut short that ended at a leaf (a tree's)
    leaf_tries: float = 0.0  # decayed leaf_reach(L) of the tree rounds whose chain was cut short

    @property
    def alpha(self) -> float:
        return (self.acc + ALPHA_PRIOR * ALPHA_PRIOR_WEIGHT) / (
            self.acc + self.rej + ALPHA_PRIOR_WEIGHT
        )

    @property
    def match(self) -> float:
        return (self.matched + MATCH_PRIOR * MATCH_PRIOR_WEIGHT) / (self.asked + MATCH_PRIOR_WEIGHT)

    @property
    def leaf_rate(self) -> float:
        """β: a cut-short tree round ends at a leaf with chance β·leaf_reach(L)."""
        return (self.leaf_hits + LEAF_PRIOR * LEAF_PRIOR_WEIGHT) / (
            self.leaf_tries + LEAF_PRIOR_WEIGHT
        )

    def update_leaves(self, leaves: int, cut_short: bool, hit: bool, decay: float) -> None:
        """A tree round of ``leaves`` leaves whose chain was ``cut_short`` (a draft rejected:
        only then can a leaf be taken), ending at a leaf or not."""
        if leaves > 0 and cut_short:
            self.leaf_hits = decay * self.leaf_hits + hit
            self.leaf_tries = decay * self.leaf_tries + float(leaf_reach(leaves))

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
