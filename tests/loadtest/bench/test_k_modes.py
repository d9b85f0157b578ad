"""The k_modes bench's interleaving: every mode once per prompt, each mode in every position."""

from loadtest.bench.k_modes import orders


def test_every_mode_runs_once_per_prompt_and_leads_in_turn():
    modes = ["plain", "K=1", "K=3", "adaptive"]
    got = orders(modes, 8)
    assert all(sorted(o) == sorted(modes) for o in got)
    firsts, lasts = [o[0] for o in got], [o[-1] for o in got]
    assert all(firsts.count(m) == 2 and lasts.count(m) == 2 for m in modes)
    assert got[0] == modes and got[1] == modes[::-1] and got[2][0] == "K=1"
