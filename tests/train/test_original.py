"""ShareGPT's own text as training rows (train/original.py): the whole-conversation rows."""

import pytest

from train.original import messages_of, whole_rows


def conv(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_only_alternating_conversations_with_an_answer_become_messages():
    good = conv(("human", "hi"), ("gpt", "hello"), ("human", "more"))
    assert messages_of(good) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    assert messages_of(conv(("gpt", "hello"), ("human", "hi"))) is None  # opens with an answer
    assert messages_of(conv(("human", "hi"), ("human", "again"))) is None
    assert messages_of(conv(("human", "hi"), ("gpt", " "))) is None  # an empty turn
    assert messages_of(conv(("human", "hi"))) is None  # no answer
    assert messages_of(conv(("system", "s"), ("human", "hi"), ("gpt", "a"))) is None


@pytest.mark.real_model
def test_a_whole_row_starts_with_the_served_chat_prompt(monkeypatch):
    """The learned part begins where the server's encoding of the first user turn ends, and the
    row is that prompt followed by the rest of the conversation in the chat template."""
    from engine.config import DEFAULT_TARGET
    from engine.model.loader import load_model
    from prompts.sets import Prompt, encode
    from train import original

    c = conv(("human", "What is 2+2?"), ("gpt", "4."), ("human", "And 3+3?"), ("gpt", "6."))
    monkeypatch.setattr(original, "conversations", lambda split: iter([c]))
    _, tok = load_model(DEFAULT_TARGET, "bfloat16")
    [(ids, start)] = list(whole_rows(tok, "train", max_prompt=512, max_len=4096))
    assert ids[:start] == encode(tok, Prompt("x", "sharegpt", "chat", "What is 2+2?"))
    rest = tok.decode(ids[start:])
    assert "4." in rest and "And 3+3?" in rest and rest.rstrip().endswith("<|im_end|>")
    assert list(whole_rows(tok, "train", max_prompt=5, max_len=4096)) == []  # prompt too long
    [(cut, _)] = list(whole_rows(tok, "train", max_prompt=512, max_len=start + 3))
    assert cut == ids[: start + 3]
