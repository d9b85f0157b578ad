"""The K controller on a synthetic machine: round costs from a formula, acceptance streams from
a coin (tests/engine/kcontrol/test_k_control.py, test_k_probe.py)."""

from __future__ import annotations

import numpy as np

from engine.kcontrol.controller import AdaptiveK
from engine.kcontrol.cost import RoundCost
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import RoundStats, Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=10**6)


def seq(i=0, params=GREEDY, spec=None):
    return Sequence(f"r{i}", [1, 2, 3], params, spec or SpecParams())


def linear_cost(a, b, c, step=0.0):
    """A synthetic machine: T(B, w) = a + b·B + c·B·w, draft steps of ``step`` seconds."""

    def t(batch, width, steps):
        return a + b * batch + c * batch * width, steps * step

    return t


def controller(true_cost, k_max=8, **kw):
    cost = RoundCost()
    for batch in (1, 4):
        for w in (0, 2, 6):
            cost.add_calibration(batch, w, true_cost(batch, w, 0)[0])
    kw.setdefault("probe_interval", 8)  # probes rare enough that "mostly K = 0" means something
    return AdaptiveK(k_max, cost=cost, **kw)


def simulate(ctrl, alphas, true_cost, batch=1, cap=8, seed=0, match=1.0):
    """Run rounds in which each drafted token is accepted with probability alpha (given the
    previous ones were); returns the batch's K per round."""
    rng = np.random.default_rng(seed)
    seqs = [seq(i) for i in range(batch)]
    ks_per_round = []
    for alpha in alphas:
        ks = [ctrl.k_for(s, cap) for s in seqs]
        width = max(ks)
        for s, k in zip(seqs, ks):
            drafted = k if rng.random() < match else 0
            accepted = 0
            while accepted < drafted and rng.random() < alpha:
                accepted += 1
            ctrl.observe(s, k, RoundStats(k, drafted, accepted, accepted + 1, 0.0, 0.0, width), cap)
        rest, draft = true_cost(batch, width, width)
        ctrl.end_round(batch, width, width, rest, draft)
        ks_per_round.append(width)
    return ks_per_round
