"""Probing: when a batch that the goodput rule keeps at K* = 0 drafts anyway
(engine/kcontrol/controller.py).

At K* = 0 nothing is observed, and α could never recover when the text turns predictable. After
``interval`` rounds at K* = 0, one round drafts ``k`` tokens for every adaptive row, spaced
further apart where a probe round costs more than ``budget`` of the rounds between two probes
(its extra cost over a plain round, priced by the cost model with the drafter's catch-up).
(Besides, each round at K = 0 ages a row's evidence, records/kstate.py, so an estimate that stopped
drafting at a dip returns towards the prior instead of waiting for a probe.)

Backoff, for batches of two rows or more: after ``GRACE`` probes in a row after which K* stayed
0, each further one doubles the spacing of the next, up to ``PROBE_BACKOFF`` times, per batch
size class (powers of two: what a batch of 8 found says little about one of 32); a round that
drafts on its own merit resets its class (its count is kept until then: requests that join a
batch of that size inherit the spacing; a probe is charged to the class of the batch that
made it). Where drafting does not pay, exploring then costs a
quarter of the budget: without the backoff, at a batch the goodput rule kept plain, the probes
cost their whole budget, gave back a fraction of it in tokens, and the batch ran below plain
(docs/measurements.md). A change for the better is found within
``PROBE_BACKOFF`` spacings instead of one (simulated: tests/engine/kcontrol/test_k_probe.py). A
single row keeps the plain spacing: one row's probe is weak evidence (at α = 0.9 one of two drafts
is rejected 19% of the time), and alone a row is where drafting pays most often, so finding out
soon matters more there than the budget.
"""

from __future__ import annotations

PROBE_BACKOFF = 4  # probes at most this many times rarer after probes that found nothing
GRACE = 2  # probes in a row that found nothing before the spacing grows


class Prober:
    """The probe schedule of one controller: :meth:`decide` once a round, after the rule."""

    def __init__(self, interval: int = 2, k: int = 2, budget: float = 0.02):
        self.interval, self.k, self.budget = interval, k, budget
        self.zero_rounds = 0  # rounds at K* = 0 since the last probe or drafting round
        self.probed: int | None = None  # the size class of the last decision, were it a probe
        self.fails: dict[int, int] = {}  # batch size class -> probes in a row that found nothing

    def backoff(self, batch: int) -> int:
        """The multiplier of the probe spacing for a batch of ``batch`` rows."""
        if batch < 2:
            return 1
        return min(2 ** max(self.fails.get(batch.bit_length(), 0) - GRACE, 0), PROBE_BACKOFF)

    def decide(self, best: int, batch: int, extra: float) -> int:
        """The round's width: the rule's ``best`` for a ``batch`` of rows, or a probe of ``k``
        where it is 0 and a probe is due; ``extra``: a probe round's predicted cost over a
        plain one's, as a fraction of it."""
        size = batch.bit_length()
        if self.probed is not None:  # the first decision on what the probe observed
            probed, self.probed = self.probed, None
            self.fails[probed] = 0 if best else self.fails.get(probed, 0) + 1
        if best > 0:
            self.fails[size], self.zero_rounds = 0, 0
            return best
        self.zero_rounds += 1
        if self.zero_rounds < max(self.interval, extra / self.budget) * self.backoff(batch):
            return 0
        self.zero_rounds, self.probed = 0, size
        return self.k
