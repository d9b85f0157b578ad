"""The round-cost model T(B, w) and its least-squares fit, on synthetic times (no model)."""

import numpy as np
import pytest

from engine.kcontrol.cost import EWLeastSquares, ForwardTable, RoundCost


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


def _bucketed(batch, q):
    return next(b for b in (1, 2, 4, 8, 16) if b >= batch), next(b for b in (1, 2, 4, 8) if b >= q)


def _forward_s(rows, q):
    """A forward bound by reading the weights up to 8 row-tokens and by compute past that."""
    return 0.008 + 0.0002 * rows + 0.0004 * max(0, rows * q - 8) ** 1.2


CALIBRATED = [(b, w) for b in (1, 2, 4, 8, 16) for w in (0, 1, 3, 7)]


def test_each_timed_shape_is_priced_as_timed_however_far_from_a_line():
    cost = RoundCost(shape=_bucketed)
    for b, w in CALIBRATED:
        cost.add_calibration(b, w, _forward_s(b, w + 1))
    assert len(cost.forward) == len(CALIBRATED)
    for b, w in CALIBRATED:
        assert cost.predict(b, w, 0) == pytest.approx(_forward_s(b, w + 1), rel=1e-6)
    assert cost.predict(5, 5, 0) == pytest.approx(_forward_s(8, 8), rel=1e-6)  # padded
    # control: the linear features alone miss the wide verify at 8 rows by far
    x = np.array([(1, b, b * w, b * (w > 0)) for b, w in CALIBRATED], dtype=float)
    y = np.array([_forward_s(b, w + 1) for b, w in CALIBRATED])
    line = np.linalg.lstsq(x, y, rcond=None)[0]
    assert abs(line @ (1, 8, 56, 8) - _forward_s(8, 8)) > 0.1 * _forward_s(8, 8)


def test_rounds_refit_the_timed_forward_s_scale_and_the_host_work():
    """Rounds cost 1.15x the timed forwards (a busier machine) plus host work per row; after
    the rounds the model prices every calibrated shape so, the ones no round ran included."""
    cost = RoundCost(shape=_bucketed, decay=0.99)
    for b, w in CALIBRATED:
        cost.add_calibration(b, w, _forward_s(b, w + 1))

    def round_s(b, w):
        rows, q = _bucketed(b, w + 1)
        return 1.15 * _forward_s(rows, q) + 0.0003 + 0.00005 * rows

    rng = np.random.default_rng(0)
    for _ in range(400):
        b, w = (1, 8)[int(rng.integers(0, 2))], int(rng.choice([0, 1, 3, 7]))
        cost.observe(b, w, 0, round_s(b, w), 0.0)
    for b, w in CALIBRATED:
        assert cost.predict(b, w, 0) == pytest.approx(round_s(b, w), rel=0.05)


def test_interpolates_between_timed_shapes():
    cost = RoundCost()
    for b in (1, 4):
        for w in (0, 3):
            cost.add_calibration(b, w, 0.01 * b + 0.002 * w)
    assert cost.forward(2, 1) == pytest.approx(0.02)
    assert cost.forward(2, 4) == pytest.approx(0.026)
    assert cost.forward(8, 4) >= cost.forward(4, 4)  # past the ends: never cheaper
    assert ForwardTable()(4, 4) == 0.0
