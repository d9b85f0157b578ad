"""The head-confidence bench's chain cut and calibration table."""

from loadtest.bench.head_confidence import calibration, cut, price


def test_cut_stops_where_the_running_product_falls_below_the_threshold():
    conf = [0.9, 0.5, 0.8, 0.1]  # running product 0.9, 0.45, 0.36, 0.036
    assert cut(conf, 0.4, keep_first=False) == 2
    assert cut(conf, 0.3, keep_first=False) == 3
    assert cut(conf, 0.01, keep_first=False) == 4
    assert cut([0.2, 0.9], 0.3, keep_first=False) == 0  # even the first draft
    assert cut([0.2, 0.9], 0.3, keep_first=True) == 1  # kept; the product 0.18 ends the chain
    assert cut([], 0.3, keep_first=True) == 0


def test_calibration_counts_only_rounds_that_reached_each_position():
    # (top probabilities, drafts accepted): position 2 is reached by the rounds accepting >= 1
    rounds = [([0.95, 0.25], 2), ([0.95, 0.25], 1), ([0.1, 0.25], 0), ([0.1, 0.95], 1)]
    first, second = calibration(rounds, 2)
    assert "0.0+ 0.50 (2)" in first and "0.9+ 1.00 (2)" in first
    assert "0.2+ 0.50 (2)" in second and "0.9+ 0.00 (1)" in second
    assert "0.0+" not in second  # no round reached position 2 with a top probability below 0.2


def test_a_cut_chain_pays_the_head_step_that_ended_it():
    round_ms = [10.0, 12.0, 15.0, 17.0]  # plain, K = 1, 2, 3
    assert price(0, round_ms, 0.5, 3) == 10.5  # the head ran once to see the first draft's q
    assert price(2, round_ms, 0.5, 3) == 15.5
    assert price(3, round_ms, 0.5, 3) == 17.0  # the whole chain: nothing more was computed
    assert price(2, round_ms, 0.5, 3, cut=False) == 15.0  # a fixed K = 2 stops at its K
