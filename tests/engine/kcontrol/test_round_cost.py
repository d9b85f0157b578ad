"""The round-cost model T(B, w) and its least-squares fit, on synthetic times (no model)."""

import numpy as np
import pytest

from engine.kcontrol.cost import EWLeastSquares, RoundCost


def test_ew_least_squares_recovers_a_line():
    fit = EWLeastSquares(3, decay=0.99)
    rng = np.random.default_rng(1)
    for _ in range(200):
        x = (1.0, rng.integers(1, 16), rng.integers(0, 64))
        fit.update(x, 0.02 + 0.003 * x[1] + 0.0005 * x[2])
    assert np.allclose(fit.theta, [0.02, 0.003, 0.0005], atol=1e-6)


def test_widths_padded_to_one_verify_shape_cost_alike():
    """On the fast path a verify pads w + 1 to a q bucket (here 1, 4, 8); the cost model prices
    the padded shape, so widths that pad to one verify shape cost alike."""
    buckets = (1, 4, 8)

    def padded(batch, q):
        return batch, next(b for b in buckets if b >= q)

    def true_cost(batch, width):  # blocks of 4 verify tokens, 10 ms each, + 12 ms
        return 0.012 + 0.010 * -(-padded(batch, width + 1)[1] // 4)

    cost = RoundCost(shape=padded)
    for w in (0, 2, 6):
        cost.add_calibration(1, w, true_cost(1, w))
    assert cost.predict(1, 1, 0) == pytest.approx(cost.predict(1, 3, 0))
    assert cost.predict(1, 4, 0) == pytest.approx(cost.predict(1, 7, 0))


def test_observed_rounds_refit_and_draft_steps_add():
    cost = RoundCost(decay=0.9)
    for batch in (1, 2, 4, 8):
        for w in (0, 3, 7):
            cost.observe(batch, w, w, 0.01 + 0.002 * batch + 0.001 * batch * w, w * 0.004)
    assert cost.observed == 12
    assert cost.predict(4, 3, 0) == pytest.approx(0.01 + 0.008 + 0.012, rel=1e-4)
    assert cost.predict(4, 3, 3) == pytest.approx(0.03 + 3 * 0.004, rel=1e-4)
    assert cost.predict(1, 0, 0) > 0 and RoundCost().predict(1, 0, 0) == 1e-6  # never <= 0


def test_the_first_verified_token_is_priced_apart():
    """A verify's cost need not be a line through w = 0 (served on 2 Xeon cores: +2.0 ms for
    2 tokens, +7.4 for 4, over a 13.8 ms decode); with the buckets calibrated the model prices
    each of them as measured, w = 1 included."""
    buckets = (1, 2, 4, 8)

    def padded(batch, q):
        return batch, next(b for b in buckets if b >= q)

    measured = {1: 0.0138, 2: 0.0158, 4: 0.0212, 8: 0.0308}  # seconds by padded q, B = 1
    cost = RoundCost(shape=padded)
    for w in (0, 1, 3, 7):
        cost.add_calibration(1, w, measured[w + 1])
    # least squares over 4 points: w = 1 within 0.2 ms (a line through them missed it by 0.3)
    assert cost.predict(1, 1, 0) == pytest.approx(measured[2], abs=2e-4)
    for w in (0, 3, 7):
        assert cost.predict(1, w, 0) == pytest.approx(measured[w + 1], abs=3e-4)
    assert cost.predict(1, 2, 0) == pytest.approx(cost.predict(1, 3, 0))  # pads to 4 tokens


def test_the_draft_phase_fit_separates_steps_from_catch_up():
    """Draft phase = s·(d + e·B) + g·C: rounds that took in C skipped positions first do not
    inflate the per-step cost, and the catch-up is priced on its own."""
    d, e, g = 0.002, 0.0001, 0.00004
    cost = RoundCost()
    rng = np.random.default_rng(0)
    for _ in range(300):
        batch, steps = int(rng.integers(1, 32)), int(rng.integers(1, 5))
        catch_up = int(rng.integers(0, 400)) if rng.random() < 0.2 else 0  # probes now and then
        cost.observe(batch, 1, steps, 0.05, steps * (d + e * batch) + g * catch_up, catch_up)
    got = cost.predict(8, 1, 2, 100) - cost.predict(8, 1, 0)
    assert got == pytest.approx(2 * (d + e * 8) + g * 100, rel=1e-3)
    assert cost.predict(8, 1, 2) - cost.predict(8, 1, 0) == pytest.approx(2 * (d + e * 8), 1e-3)
