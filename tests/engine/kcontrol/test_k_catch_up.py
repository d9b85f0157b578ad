"""AdaptiveK prices a stateful drafter's catch-up: the positions beyond one a row that the
drafter takes in first for what its state missed (kcontrol/controller.py, "Catch-up"), on
synthetic costs (no model). The simulated drafter here is a draft model (its backlog grows by
one each round the row does not draft) or an EAGLE head (its backlog stays below 2·WINDOW)."""

import numpy as np

from engine.kcontrol.controller import AdaptiveK, FixedK
from engine.kcontrol.cost import RoundCost
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import RoundStats
from tests import helpers

from .test_k_control import CHEAP_VERIFY, seq

BATCH, STEP = 8, 0.001  # rows; seconds of one draft step


def drafted_rounds(cap: int, catch_up_s: float, rounds=600, pinned=False, priced=True) -> list:
    """Rounds in which the adaptive rows drafted, for a batch whose rows accept nothing (α =
    0.01: K* = 0 but for probes and aging). The draft phase costs ``STEP`` a step plus
    ``catch_up_s`` a position of backlog, a row's backlog growing by one a round at K = 0 up to
    ``cap`` and back to 0 when it drafts. ``pinned``: one more row drafts K = 1 every round."""
    cost = RoundCost()
    for w in (0, 2, 6):
        cost.add_calibration(BATCH, w, CHEAP_VERIFY(BATCH, w, 0)[0])
    cost.add_step_calibration(BATCH, STEP)
    ctrl = AdaptiveK(8, cost=cost, always_drafts=True, price_catch_up=priced)
    rng = np.random.default_rng(0)
    seqs = [seq(i, spec=SpecParams(k=1) if pinned and i == 0 else None) for i in range(BATCH)]
    drafted = []
    for r in range(rounds):
        ks = [ctrl.k_for(s, 8) for s in seqs]
        width = max(ks)
        caught = sum(s.kstate.backlog for s, k in zip(seqs, ks) if k)
        for s, k in zip(seqs, ks):
            acc = int(k > 0 and rng.random() < 0.01)
            ctrl.observe(s, k, RoundStats(k, k, acc, acc + 1, 0.0, 0.0, width), 8)
        for s, k in zip(seqs, ks):  # the drafter's state after commit
            s.kstate.backlog = 0 if k else min(s.kstate.backlog + 1, cap)
        rest = CHEAP_VERIFY(BATCH, width, 0)[0]
        draft = width * STEP + caught * catch_up_s if width else 0.0
        ctrl.end_round(BATCH, width, width, rest, draft, caught)
        if max(ks[1:]):
            drafted.append(r)
    return drafted


def test_an_unbounded_catch_up_dearer_than_the_budget_stops_drafting():
    """A draft model at a large batch: catching up one skipped round of the batch costs 2.8% of
    a plain round (> the 2% probe budget). Once the first drafts after a stretch at K = 0 have
    measured the catch-up, neither a probe nor a row's aged estimate pays for it: the batch
    stays plain. Unpriced, it resumes every ~7 rounds, as a stateless drafter does."""
    t0 = CHEAP_VERIFY(BATCH, 0, 0)[0]
    assert BATCH * 0.0002 / t0 > 0.02
    assert len(drafted_rounds(0, 0.0)) >= 60
    assert len(drafted_rounds(1 << 20, 0.0002, priced=False)) >= 60
    assert len(drafted_rounds(1 << 20, 0.0002)) <= 3


def test_a_row_pinned_at_k_does_not_hide_the_catch_up():
    """A row with a fixed K = 1 widens every verify, so the adaptive rows could draft a token at
    no verify cost: they do when their drafter holds no backlog, and not when catching up
    costs more than their drafts can gain (the catch-up is added only where they draft)."""
    for backlog, want_draft in ((0, True), (100, False)):
        cost = RoundCost()
        for w in (0, 2, 6):
            cost.add_calibration(BATCH, w, CHEAP_VERIFY(BATCH, w, 0)[0])
        cost.add_step_calibration(BATCH, STEP)
        cost.add_step_calibration(BATCH, STEP + 0.2, catch_up=1000)  # 0.2 ms a position
        ctrl = AdaptiveK(8, cost=cost, always_drafts=True)
        seqs = [seq(i, spec=SpecParams(k=1) if i == 0 else None) for i in range(BATCH)]
        for s in seqs:
            k = 1 if s.spec.k else 0
            ctrl.observe(s, k, RoundStats(k, k, 0, 1, 0.0, 0.0, 1), 8)
            s.kstate.backlog = 0 if s.spec.k else backlog
        ctrl.end_round(BATCH, 1, 1, CHEAP_VERIFY(BATCH, 1, 0)[0], STEP)
        assert (ctrl.k_for(seqs[1], 8) > 0) is want_draft


def test_a_bounded_catch_up_spaces_the_drafts():
    """An EAGLE head's catch-up is bounded (it keeps fewer than 2·WINDOW pending positions a
    row): it still resumes drafting now and then, further apart than a stateless drafter."""
    free, head = drafted_rounds(0, 0.0), drafted_rounds(31, 0.0002)
    assert 3 <= len(head) <= len(free) / 3


class PlainThenK(FixedK):
    """K = 0 for the first ``plain`` rounds, then K; records end_round's catch-up."""

    def __init__(self, plain: int, k: int):
        super().__init__(k)
        self.plain, self.catch_ups = plain, []

    def k_for(self, seq, cap):
        return 0 if self.plain > 0 else super().k_for(seq, cap)

    def end_round(self, batch, width, steps, rest_s, draft_s, catch_up=0, extra_rows=0, tree=False):
        self.plain -= 1
        self.catch_ups.append(catch_up)


def test_a_draft_models_backlog_is_every_token_it_missed(tiny_llama):
    """A draft model's backlog grows by one token a round at K = 0, with no bound; the round
    that drafts again reports it as its catch-up and takes it in (backlog 0 after, or 1 after
    an all-accepted round: d_K and the bonus token unseen)."""
    g = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = helpers.engine_for(tiny_llama, "self", slots=4)
    engine.speculator.controller = ctl = PlainThenK(12, 2)
    seqs = [engine.add_request(str(i), [3 + i, 5, 7, 11], g, SpecParams()) for i in range(3)]
    engine.step()  # prefill, first token and a first round at K = 0: one token unseen
    assert [s.kstate.backlog for s in seqs] == [1] * 3
    for r in range(2, 11):
        engine.step()
        assert [s.kstate.backlog for s in seqs] == [r] * 3
    while not any(s.drafted for s in seqs):  # up to the first drafting round
        backlog = sum(s.kstate.backlog for s in seqs)
        engine.step()
    assert ctl.catch_ups[-1] == backlog > 30 and all(s.kstate.backlog <= 1 for s in seqs)
