"""The probe schedule (engine/kcontrol/probe.py): spacing by cost, the backoff after probes that
found nothing (batches of two rows or more, per size class, reset by a drafting round), and what it
buys and costs the adaptive controller on a synthetic machine where drafting stops paying and
pays again."""

import pytest

from engine.kcontrol import probe as k_probe
from engine.kcontrol.probe import GRACE, PROBE_BACKOFF, Prober
from tests.kcontrol_sim import controller, linear_cost, simulate


def gaps(prober: Prober, batch: int, probes: int, extra: float = 0.2) -> list[int]:
    """Rounds from one probe to the next, the rule asking K = 0 every round (every probe fails)."""
    out, since = [], 0
    while len(out) < probes:
        since += 1
        if prober.decide(0, batch, extra):
            out.append(since)
            since = 0
    return out


def test_spacing_grows_after_the_grace_per_size_class_and_resets_on_a_drafting_round():
    p = Prober(interval=2, k=2, budget=0.02)  # a probe costs 20% more: one in 10 rounds
    assert gaps(p, 8, 6) == [10, 10, 10, 20, 40, 40]  # GRACE failures, then x2 up to x4
    assert (GRACE, PROBE_BACKOFF) == (2, 4)
    assert gaps(p, 16, 2) == [10, 10]  # another size class: its own count
    assert gaps(p, 1, 8) == [10] * 8  # a single row keeps the plain spacing
    assert p.decide(3, 8, 0.2) == 3  # the rule drafts on its own: the class starts over
    assert gaps(p, 8, 4) == [10, 10, 10, 20]
    assert gaps(p, 8, 1, extra=0.01) == [8]  # (cheap probes: the interval, 2, times 4)


def test_a_probe_that_found_drafting_worth_it_resets_the_count():
    p = Prober(interval=2, k=2, budget=0.02)
    gaps(p, 8, 4)  # 4 probes, the last not judged yet: 3 failures, x2
    assert p.backoff(8) == 2
    while not p.decide(0, 8, 0.2):  # the 4th fails (x4), and the 5th probe comes
        pass
    assert p.backoff(8) == 4
    assert p.decide(2, 8, 0.2) == 2  # the decision on the probe's evidence drafts
    assert p.backoff(8) == 1


def test_a_probe_is_charged_to_the_size_class_of_the_batch_that_made_it():
    p = Prober(interval=2, k=2, budget=0.02)
    while not p.decide(0, 8, 0.2):  # a probe at batch 8 ...
        pass
    p.decide(0, 16, 0.2)  # ... judged when the batch has grown to 16
    assert p.fails == {(8).bit_length(): 1}
    while not p.decide(0, 16, 0.2):
        pass
    p.decide(1, 1, 0.2)  # judged at batch 1, where the rule drafts: both classes reset
    assert p.fails == {(16).bit_length(): 0, (8).bit_length(): 1, 1: 0}


BATCH8 = linear_cost(0.050, 0.002, 0.004)  # batch 8: K = 1 costs 1.48x a plain round


@pytest.mark.parametrize("backoff", [1, PROBE_BACKOFF])
def test_exploring_costs_a_quarter_where_drafting_does_not_pay_and_recovery_stays_bounded(
    backoff, monkeypatch
):
    """Batch 8, α = 0.3 for 1,500 rounds (drafting never pays), then 0.9 (K = 1 pays 1.28x).
    Without the backoff the probes take their 2% budget of the time; with it, under 0.6%. And
    drafting resumes within PROBE_BACKOFF probe spacings (a probe costs ~0.97 of a round: one
    in ~49 rounds at the 2% budget)."""
    monkeypatch.setattr(k_probe, "PROBE_BACKOFF", backoff)
    ctrl = controller(BATCH8)
    ks = simulate(ctrl, [0.3] * 1500 + [0.9] * 600, BATCH8, batch=8, seed=1)
    steady = ks[500:1500]
    seconds = sum(sum(BATCH8(8, w, w)) for w in steady)
    overhead = seconds / (len(steady) * BATCH8(8, 0, 0)[0]) - 1.0
    resumed = next(i for i, k in enumerate(ks[1500:]) if all(ks[1500 + i : 1505 + i]))
    spacing = (BATCH8(8, 2, 2)[0] / BATCH8(8, 0, 0)[0] - 1.0) / ctrl.prober.budget
    if backoff == 1:
        assert 0.015 < overhead < 0.025
    else:
        assert overhead < 0.006
    assert resumed <= backoff * spacing + 10
