"""AdaptiveK prices a probe's catch-up: the positions a stateful drafter takes in for the rounds
a row spent at K = 0 (k_control.py, "Probing"), on synthetic costs (no model)."""

import numpy as np

from engine.k_control import AdaptiveK
from engine.round_cost import RoundCost
from engine.sequence import RoundStats

from .test_k_control import CHEAP_VERIFY, seq

BATCH, STEP = 8, 0.001  # rows; seconds of one draft step


def probes(catch_up_cap: int, catch_up_s: float, rounds: int = 600) -> list[int]:
    """Rounds that drafted, for a batch whose rows accept nothing (α = 0.01: K* = 0 but for
    probes and aging), where the draft phase costs ``STEP`` a step plus ``catch_up_s`` for each
    position a row takes in for a round it did not draft (at most ``catch_up_cap`` per row)."""
    cost = RoundCost()
    for w in (0, 2, 6):
        cost.add_calibration(BATCH, w, CHEAP_VERIFY(BATCH, w, 0)[0])
    cost.add_step_calibration(BATCH, STEP)
    ctrl = AdaptiveK(8, cost=cost, always_drafts=True, catch_up_cap=catch_up_cap)
    rng = np.random.default_rng(0)
    seqs = [seq(i) for i in range(BATCH)]
    drafted = []
    for r in range(rounds):
        ks = [ctrl.k_for(s, 8) for s in seqs]
        width = max(ks)
        backlog = sum(min(s.kstate.idle, catch_up_cap) for s, k in zip(seqs, ks) if k)
        for s, k in zip(seqs, ks):
            acc = int(k > 0 and rng.random() < 0.01)
            ctrl.observe(s, k, RoundStats(k, k, acc, acc + 1, 0.0, 0.0, width), 8)
        rest = CHEAP_VERIFY(BATCH, width, 0)[0]
        draft = width * STEP + backlog * catch_up_s if width else 0.0
        ctrl.end_round(BATCH, width, width, rest, draft)
        if width:
            drafted.append(r)
    return drafted


def test_an_unbounded_catch_up_dearer_than_the_budget_stops_drafting():
    """A draft model at a large batch: catching up one skipped round of the batch costs 2.8% of
    a plain round (> the 2% probe budget). Once the first drafts after a stretch at K = 0 have
    measured the catch-up, neither a probe nor a row's aged estimate pays for it: the batch
    stays plain (without the catch-up priced it resumed every ~7 rounds, as the stateless
    drafter here does)."""
    t0 = CHEAP_VERIFY(BATCH, 0, 0)[0]
    assert BATCH * 0.0002 / t0 > 0.02
    assert len(probes(0, 0.0)) >= 60 and len(probes(1 << 20, 0.0002)) <= 3


def test_a_bounded_catch_up_spaces_the_drafts():
    """An EAGLE head's catch-up is bounded (it keeps at most 2·WINDOW pending positions a row):
    it still resumes drafting now and then, further apart than a stateless drafter."""
    free, head = probes(0, 0.0), probes(32, 0.0002)
    assert 3 <= len(head) <= len(free) / 3
