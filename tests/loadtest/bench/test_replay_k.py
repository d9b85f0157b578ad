"""The offline controller replay: traces are what n-gram lookup + greedy verification would do,
and a replayed round emits exactly the accepted tokens plus one."""

from engine.kcontrol.controller import FixedK, HeuristicK
from loadtest.bench.replay_k import replay, trace


def test_trace_counts_drafts_and_accepted_prefixes():
    prompt = [1, 2, 3, 4, 1, 2, 3]
    output = [4, 1, 2, 9]  # the copy of "4 1 2 3" breaks at the last token
    tr = trace(prompt, output, k_max=3)
    # at t=0 the context ends "1 2 3": lookup proposes "4 1 2", all three right
    assert tr[0] == (3, 3)
    # at t=3 the context ends "3 4 1 2": lookup proposes "3 ...", the output has 9
    assert tr[3][1] == 0 and tr[3][0] >= 1


def test_replay_rounds_and_time():
    # every position drafts 8 and the target accepts 2 of them
    tr = [(8, 2)] * 12
    table = {w: 0.010 + 0.001 * w for w in range(9)}
    seconds, rounds = replay(FixedK(4), tr, table, 8)
    assert rounds == 4  # 3 tokens per round; the last round is capped at the 2 tokens left after it
    assert abs(seconds - 3 * (table[4] + 2e-4) - (table[2] + 2e-4)) < 1e-9
    seconds0, rounds0 = replay(FixedK(0), tr, table, 8)
    assert rounds0 == 12 and abs(seconds0 - 12 * table[0]) < 1e-9
    _, rounds_h = replay(HeuristicK(1, 8), [(8, 8)] * 30, table, 8)
    assert rounds_h < 30 / 2  # K grows 1, 3, 5, 7, 8 on a text that is copied whole
