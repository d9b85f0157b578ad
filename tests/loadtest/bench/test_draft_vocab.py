"""The draft-vocabulary bench (loadtest/bench/draft_vocab.py): its speed model, and a run over a
few answers that prints a row per size with coverage growing with the size."""

import json

import pytest

from loadtest.bench import draft_vocab


def test_k1_speed_model():
    # the same coverage and no extra time: the base itself
    assert draft_vocab.k1_speed(0.5, 0.9, 0.9, 0.0, 15.0) == pytest.approx(1.0)
    # full coverage where the base had 0.9: agreement 0.5 -> 0.5555, tau 1.5 -> 1.5555
    assert draft_vocab.k1_speed(0.5, 1.0, 0.9, 0.0, 15.0) == pytest.approx(1.5555 / 1.5, rel=1e-4)
    # 1.5 ms more on a 15 ms round costs 1/1.1
    assert draft_vocab.k1_speed(0.5, 0.9, 0.9, 1.5, 15.0) == pytest.approx(1 / 1.1)


def test_bench_prints_coverage_by_size(tmp_path, capsys):
    def write(name, answers, temperature):
        with open(tmp_path / name, "w") as f:
            for out in answers:
                row = {"prompt_ids": [1, 2], "output_ids": out, "temperature": temperature}
                f.write(json.dumps(row) + "\n")

    # counts in the training answers: 5 x4, 6 x3, 7 x2, 8 x1 (no ties)
    write("train.jsonl", [[5, 5, 5, 6, 6, 7], [5, 6, 7, 8]], 0.7)
    write("eval.jsonl", [[5, 6, 7, 9]], 0.0)
    with open(tmp_path / "eval.jsonl", "a") as f:  # a sampled answer: in "cov e", not greedy's
        f.write(json.dumps({"prompt_ids": [1, 2], "output_ids": [9, 9, 9, 9], "temperature": 0.7}))
    argv = [f"--train={tmp_path / 'train.jsonl'}", f"--eval={tmp_path / 'eval.jsonl'}"]
    assert draft_vocab.main(argv + ["--sizes=1,2,3", "--head=", "--base=2", "--hidden=64"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    table = {int(r[0]): r for r in rows[1:]}
    assert sorted(table) == [1, 2, 3]
    # e's answer 5 6 7 9: the top-1 vocabulary {5} covers 1/4, {5, 6} 2/4, {5, 6, 7} 3/4
    assert [float(table[n][4]) for n in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert [float(table[n][3]) for n in (1, 2, 3)] == [0.125, 0.25, 0.375]  # both e answers
    assert float(table[3][2]) == 0.9  # 9 of the 10 training answer tokens
    assert float(table[2][6]) == 0.0 and float(table[2][7]) == 1.0  # the base against itself


def test_bench_takes_a_heads_own_vocabulary_as_the_base(tmp_path, capsys):
    from engine.drafters.eagle.head import save_head
    from tests.eagle_builders import random_head

    head = random_head(1, vocab=64, draft_vocab=32)  # draft ids: 32 of the 64 target ids
    save_head(head, tmp_path / "head")
    inside = head.draft_to_target.tolist()
    with open(tmp_path / "eval.jsonl", "w") as f:
        f.write(json.dumps({"prompt_ids": [1], "output_ids": inside[:3], "temperature": 0}))
    argv = [f"--train={tmp_path / 'eval.jsonl'}", f"--eval={tmp_path / 'eval.jsonl'}"]
    assert draft_vocab.main(argv + ["--sizes=1", f"--head={tmp_path / 'head'}"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    table = {r[0]: r for r in rows[1:]}
    assert table["head"][1] == "32" and float(table["head"][4]) == 1.0
    assert float(table["1"][4]) == pytest.approx(1 / 3, abs=1e-3)
    assert float(table["head"][7]) == 1.0
