"""The K controllers on synthetic acceptance streams and synthetic round costs (no model)."""

import itertools

import numpy as np

from engine.kcontrol.controller import AdaptiveK, FixedK, HeuristicK, KController, expected_tokens
from engine.kcontrol.cost import RoundCost
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import RoundStats, Sequence
from tests.kcontrol_sim import controller, linear_cost, simulate

GREEDY = SamplingParams(temperature=0, max_tokens=10**6)


def seq(i=0, params=GREEDY, spec=None):
    return Sequence(f"r{i}", [1, 2, 3], params, spec or SpecParams())


CHEAP_VERIFY = linear_cost(0.050, 0.001, 0.002)  # GPU-like: a verified token costs ~4% of a round


def mostly_zero(ks, ctrl):
    """K = 0 in every round but the probes (one in probe_interval rounds, at probe_k) and a
    round after a probe at most."""
    nonzero = [k for k in ks if k]
    return len(nonzero) <= 2 * len(ks) / ctrl.prober.interval + 2 and max(ks) <= ctrl.prober.k


CPU_LINEAR = linear_cost(0.010, 0.010, 0.010)  # each verified token costs a full token's time


def test_expected_tokens():
    ks = np.arange(4)
    assert np.allclose(expected_tokens(0.5, 1.0, ks), [1, 1.5, 1.75, 1.875])
    assert np.allclose(expected_tokens(1.0, 1.0, ks), [1, 2, 3, 4])
    assert np.allclose(expected_tokens(0.5, 0.0, ks), [1, 1, 1, 1])
    # rows at once ([rows, 1] against [rows, widths]: what the adaptive rule sums) equal rows alone
    rng = np.random.default_rng(0)
    alpha, match, cap = rng.uniform(0, 1, 40), rng.uniform(0, 1, 40), rng.integers(0, 9, 40)
    alpha[:4] = 1.0
    widths = np.arange(9)
    rows = expected_tokens(alpha[:, None], match[:, None], np.minimum(widths, cap[:, None]))
    alone = [expected_tokens(a, m, np.minimum(widths, c)) for a, m, c in zip(alpha, match, cap)]
    assert np.allclose(rows, alone, rtol=1e-12)
    assert np.allclose(rows[:4], 1 + match[:4, None] * np.minimum(widths, cap[:4, None]))


def goodput_over_plain(ks, alpha, cost) -> float:
    """Expected tokens per second of the rounds ``ks`` over plain decoding's."""
    seconds = sum(sum(cost(1, w, w)) for w in ks)
    tokens = sum(expected_tokens(alpha, 1.0, np.array(w)) for w in ks)
    return float(tokens / seconds * cost(1, 0, 0)[0])


def test_converges_to_zero_when_alpha_near_zero():
    ctrl = controller(CPU_LINEAR)
    ks = simulate(ctrl, [0.01] * 200, CPU_LINEAR)
    assert mostly_zero(ks[50:], ctrl)


def test_near_zero_alpha_costs_little_where_a_draft_is_cheap():
    """Where a verified token costs ~4% of a round (GPU-like), a row at α ≈ 0 keeps drafting a
    token now and then: between drafts its evidence ages (records.kstate.IDLE_DECAY) and its
    estimate rises back over break-even. What that exploring costs stays within a few per cent of
    plain decoding (the probes' budget is 2%)."""
    ks = simulate(controller(CHEAP_VERIFY), [0.01] * 400, CHEAP_VERIFY)[50:]
    assert max(ks) <= 2 and goodput_over_plain(ks, 0.01, CHEAP_VERIFY) > 0.975


def test_converges_to_large_k_when_alpha_near_one():
    ctrl = controller(CHEAP_VERIFY)
    ks = simulate(ctrl, [0.99] * 100, CHEAP_VERIFY)
    assert min(ks[20:]) >= 6 and ks[-1] == 8


def test_cpu_linear_cost_speculates_only_when_it_pays():
    # verify costs ~linear in tokens: at alpha 0.9 K=1..2 pay, at 0.5 nothing beats plain much
    # (a probe doubles the round here, so probes are 50 rounds apart: the 2% probe budget)
    hi = simulate(controller(CPU_LINEAR), [0.9] * 200, CPU_LINEAR)
    assert np.mean(hi[100:]) >= 1
    ctrl = controller(CPU_LINEAR)
    lo = simulate(ctrl, [0.3] * 100, CPU_LINEAR)
    assert mostly_zero(lo[30:], ctrl)


def test_expects_drafts_follows_the_next_rounds_k():
    """Whether rows are likely to draft soon (a drafter defers prompt work when not): the
    adaptive rule until it decided, then whether its K* for the next round is above 0."""
    ctrl = controller(CHEAP_VERIFY)
    assert ctrl.expects_drafts()  # nothing decided yet
    ks = simulate(ctrl, [0.99] * 30, CHEAP_VERIFY)
    assert ks[-1] > 0 and ctrl.expects_drafts()
    ctrl = controller(CPU_LINEAR)
    simulate(ctrl, [0.01] * 60, CPU_LINEAR)  # K* = 0 by now, a probe round now and then
    seen = []
    for _ in range(40):
        k = simulate(ctrl, [0.01], CPU_LINEAR)[0]
        seen.append((k, ctrl.expects_drafts()))
    assert {e for _, e in seen} == {True, False}  # False after most rounds, True before a probe
    assert all(prev_e == (k > 0) for (_, prev_e), (k, _) in itertools.pairwise(seen))
    assert FixedK(2).expects_drafts() and not FixedK(0).expects_drafts()
    assert HeuristicK(1, 4).expects_drafts()


def test_follows_a_change_of_alpha_within_bounded_rounds():
    ctrl = controller(CHEAP_VERIFY, probe_interval=16)
    ks = simulate(ctrl, [0.95] * 60 + [0.02] * 60 + [0.95] * 60, CHEAP_VERIFY, seed=3)
    assert min(ks[30:60]) >= 4  # predictable: large K
    assert all(k <= ctrl.prober.k for k in ks[60 + 10 : 120])  # down within 10 rounds
    recovered = next(i for i, k in enumerate(ks[120:]) if k >= 4)
    assert recovered <= ctrl.prober.interval + 10  # within a probe interval and a few rounds


def test_speculation_shrinks_as_the_batch_grows():
    cost = linear_cost(0.050, 0.002, 0.002)
    k1 = simulate(controller(cost), [0.6] * 80, cost, batch=1)
    k64 = simulate(controller(cost), [0.6] * 80, cost, batch=64)
    assert np.mean(k1[30:]) >= 2
    assert np.mean([k == 0 for k in k64[30:]]) > 0.8


def test_drafts_the_widest_width_of_a_verify_shape():
    """On the fast path a verify pads w + 1 to a q bucket (here 1, 4, 8: the CPU int4 matmul
    works in blocks of 4 rows); the cost model prices the padded shape (test_round_cost.py), so
    at a good α the controller drafts 3 (as dear as 1 or 2) rather than 1 or 2, and 7 rather
    than 4..6."""
    buckets = (1, 4, 8)

    def padded(batch, q):
        return batch, next(b for b in buckets if b >= q)

    def true_cost(batch, width, steps):  # blocks of 4 verify tokens, 10 ms each, + 12 ms
        return 0.012 + 0.010 * -(-padded(batch, width + 1)[1] // 4), 0.0

    cost = RoundCost(shape=padded)
    for w in (0, 2, 6):
        cost.add_calibration(1, w, true_cost(1, w, 0)[0])
    ctrl = AdaptiveK(7, cost=cost)
    ks = simulate(ctrl, [0.7] * 60, true_cost, cap=7, seed=1)
    assert set(ks) <= {0, 3, 7}
    assert ks[10:].count(3) > 0.8 * len(ks[10:])


def test_k_stays_within_bounds_on_random_streams():
    rng = np.random.default_rng(7)
    for _ in range(20):
        k_max = int(rng.integers(0, 10))
        cost = linear_cost(*rng.uniform(0.001, 0.05, 3))
        ctrl = controller(cost, k_max=k_max)
        s = seq()
        for _ in range(60):
            cap = int(rng.integers(0, 12))
            k = ctrl.k_for(s, cap)
            assert 0 <= k <= min(cap, k_max)
            drafted = int(rng.integers(0, k + 1))
            accepted = int(rng.integers(0, drafted + 1))
            ctrl.observe(s, k, RoundStats(k, drafted, accepted, accepted + 1, 0, 0, k), cap)
            ctrl.end_round(1, k, k, *cost(1, k, k))


def test_pinned_requests():
    ctrl = controller(CHEAP_VERIFY)
    simulate(ctrl, [0.99] * 30, CHEAP_VERIFY)
    assert ctrl.k_for(seq(), 8) == 8
    assert ctrl.k_for(seq(spec=SpecParams(k=3)), 8) == 3  # a fixed k wins
    assert ctrl.k_for(seq(spec=SpecParams(k=3)), 2) == 2  # capped
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=100)
    assert ctrl.k_for(seq(params=seeded), 8) == 0  # seeded sampling reproduces: no adaptive K
    assert ctrl.k_for(seq(params=seeded, spec=SpecParams(k=2)), 8) == 2
    assert ctrl.k_for(seq(), 0) == 0


def test_uncalibrated_adaptive_does_not_speculate():
    ctrl = AdaptiveK(8)
    assert not ctrl.calibrated and ctrl.k_for(seq(), 8) == 0


def test_heuristic_schedule():
    ctrl = HeuristicK(k_init=4, k_max=8)
    s = seq()
    assert ctrl.k_for(s, 8) == 4
    ctrl.observe(s, 4, RoundStats(4, 4, 4, 5, 0, 0, 4), 8)
    assert ctrl.k_for(s, 8) == 6
    ctrl.observe(s, 6, RoundStats(6, 6, 6, 7, 0, 0, 6), 8)
    assert ctrl.k_for(s, 8) == 8  # capped at k_max
    ctrl.observe(s, 8, RoundStats(8, 8, 2, 3, 0, 0, 8), 8)
    assert ctrl.k_for(s, 8) == 7
    for _ in range(10):
        ctrl.observe(s, 1, RoundStats(1, 1, 0, 1, 0, 0, 1), 8)
    assert ctrl.k_for(s, 8) == 1  # never below 1
    assert ctrl.k_for(s, 0) == 0


def test_fixed():
    assert FixedK(4).k_for(seq(), 8) == 4 and FixedK(4).k_for(seq(), 2) == 2


def test_price_shapes_sets_the_cost_models_shape():
    def padded(batch, q):
        return batch, 8

    ctrl = AdaptiveK(4)
    ctrl.price_shapes(padded)
    assert ctrl.cost.shape is padded
    FixedK(2).price_shapes(padded)  # the default: nothing to price
    HeuristicK(1, 4).price_shapes(padded)
    assert KController().calibrated


def test_adaptive_accepts_any_cost_model():
    """AdaptiveK depends on the CostModel protocol, not on RoundCost."""

    class Flat:
        shape = staticmethod(lambda batch, q: (batch, q))

        def observe(
            self, batch, width, steps, rest_s, draft_s, catch_up=0, extra_rows=0, tree=False
        ):
            pass

        def predict(self, batch, width, steps, catch_up=0, tree=False):
            return 1.0  # drafting is free: the widest width wins

        def add_calibration(self, batch, width, seconds):
            pass

        def add_step_calibration(self, batch, seconds, catch_up=0):
            pass

    ctrl = AdaptiveK(5, cost=Flat())
    assert ctrl.calibrated and ctrl.k_for(seq(), 8) == 5


def test_a_drafter_that_always_proposes_is_priced_with_match_one():
    """A fresh row's match rate is its prior (0.5): right for n-gram lookups, which may find
    nothing, but it halves both the gain and the cost of a draft that a model always makes.
    Here (α prior 0.5, a 1-token verify costing 1.48x a plain round) K = 1 gains 1.35% at
    m = 1 and 0.8% at m = 0.5, so only the controller told that the drafter always proposes
    drafts (min_gain 1%)."""
    cost = linear_cost(0.050, 0.0, 0.024)
    assert controller(cost, always_drafts=True).k_for(seq(), 8) == 1
    assert controller(cost).k_for(seq(), 8) == 0


def test_builder_tells_the_controller_which_drafters_always_propose():
    from types import SimpleNamespace

    from engine.builder import make_controller

    d = SimpleNamespace(controller="adaptive", k_max=4, min_gain=0.01, probe_interval=2,
                        probe_k=2, probe_budget=0.02, tree_leaves=3, tree_topk=4,
                        method="eagle3")  # fmt: skip
    for samples in (True, False):  # a model drafter samples and always proposes; n-gram neither
        # and only a drafter that proposes runners-up (the EAGLE-3 head) is given tree leaves
        drafter = SimpleNamespace(samples=samples, steps=lambda w: w, trees=samples)
        ctrl = make_controller(d, drafter)
        assert isinstance(ctrl, AdaptiveK) and ctrl.always_drafts is samples
        assert ctrl.max_leaves == (3 if samples else 0)
        assert ctrl.expand_rows == (3 if samples else 0)  # an expanding head's B - 1 extras
    # the suffix drafter's trees are branches of its index: leaves, but no head rows to price
    suffix = SimpleNamespace(samples=False, steps=lambda w: w, trees=True)
    ctrl = make_controller(SimpleNamespace(**{**vars(d), "method": "suffix"}), suffix)
    assert isinstance(ctrl, AdaptiveK) and ctrl.max_leaves == 3 and ctrl.expand_rows == 0


def test_reset_forgets_the_probe_backoff_and_the_next_round_but_keeps_the_costs():
    """After probes that found nothing (the probe spacing backed off for batches of 8),
    ``reset`` probes as a fresh controller does; the measured costs are kept."""
    ctrl = controller(CPU_LINEAR)
    simulate(ctrl, [0.0] * 50, CPU_LINEAR, batch=8)

    def gap(prober):  # rounds to the next probe, the rule asking K = 0 (the probe fails)
        n = 1
        while not prober.decide(0, 8, 0.2):
            n += 1
        return n

    for _ in range(6):
        gap(ctrl.prober)
    backed_off = gap(ctrl.prober)
    observed = ctrl.cost.observed
    ctrl.reset()
    fresh = controller(CPU_LINEAR).prober
    assert gap(ctrl.prober) == gap(fresh) < backed_off
    assert ctrl.cost.observed == observed > 0
