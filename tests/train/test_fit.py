"""The fit's schedule over epochs and its report (train/fit.py)."""

from train.fit import epoch_order, simulated_tau


def test_epochs_visit_every_batch_once_in_a_fixed_order():
    assert epoch_order(10, 0, seed=3) == list(range(10))
    one, two = epoch_order(10, 1, seed=3), epoch_order(10, 2, seed=3)
    assert sorted(one) == sorted(two) == list(range(10))
    assert one != two and one != list(range(10))
    assert one == epoch_order(10, 1, seed=3)  # a resumed run continues the same order


def test_simulated_tau_chains_the_agreements():
    assert simulated_tau([0.5, 0.5], 3) == 1 + 0.5 + 0.25 + 0.125  # the last step repeats
    assert simulated_tau([1.0], 4) == 5.0 and simulated_tau([0.0, 1.0], 3) == 1.0
