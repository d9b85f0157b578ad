"""server/generation.py: where a choice's text, usage and logprobs end."""

from engine.records.output import StepOutput
from server.generation import _text
from server.textstream import IncrementalDetokenizer, StopFilter


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)


def ids(s: str) -> list[int]:
    return [ord(c) for c in s]


def run(outputs: list[str], stops: list[str]) -> tuple[str, int]:
    detok, filt = IncrementalDetokenizer(CharTokenizer(), ids("> ")), StopFilter(stops)
    text, used = "", 0
    for i, chunk in enumerate(outputs):
        out = StepOutput("r", ids(chunk), i == len(outputs) - 1, None)
        t, n = _text(out, detok, filt)
        text, used = text + t, used + n
        if filt.stopped:
            break
    return text, used


def test_a_round_past_the_stop_string_counts_up_to_the_token_that_completes_it():
    one_at_a_time = run(list("hello world, bye"), ["o w"])
    assert one_at_a_time == ("hell", 7)  # "h e l l o ' ' w": the 7th token completes "o w"
    assert run(["hel", "lo world, ", "bye"], ["o w"]) == one_at_a_time  # rounds of many tokens
    assert run(["hello world, bye"], ["o w"]) == one_at_a_time


def test_without_a_stop_every_token_counts():
    assert run(["hel", "lo"], []) == ("hello", 5)
    assert run(["hel", "lo"], ["xyz"]) == ("hello", 5)
