from train.distill import still_to_answer


def _encode(conv_id: str, text: str) -> list[int]:
    return [ord(c) for c in text]


TURNS = [("a", "hi"), ("b", "a long prompt"), ("c", "yo"), ("d", "ok"), ("e", "no")]


def test_limit_counts_the_answers_already_written():
    assert still_to_answer(TURNS, {"a", "c", "d"}, _encode, 8, 3) == []
    got = still_to_answer(TURNS, {"a"}, _encode, 8, 3)
    assert [c for c, _, _ in got] == ["c", "d"]  # "b" is too long; a + c + d = 3


def test_no_limit_takes_every_short_prompt_not_done_in_order():
    got = still_to_answer(TURNS, {"d"}, _encode, 8, 0)
    want = [("a", [104, 105]), ("c", [121, 111]), ("e", [110, 111])]
    assert [(c, ids) for c, ids, _ in got] == want


def test_offset_passes_over_the_first_short_prompts_answered_or_not():
    # eligible in order: a, c, d, e ("b" is too long); offset 2 passes over a and c
    got = still_to_answer(TURNS, set(), _encode, 8, 0, offset=2)
    assert [c for c, _, _ in got] == ["d", "e"]
    got = still_to_answer(TURNS, {"e"}, _encode, 8, 0, offset=2)
    assert [c for c, _, _ in got] == ["d"]
