"""server/tool_stream.py: a tool-mode output read as it grows gives, for any split of its text
into events, the same calls (announced once, name whole, arguments concatenating to the raw
``arguments`` text that read_output returns too) and the same decoded answer text, never cutting
an escape or a surrogate pair."""

import json
import random

import pytest

from server.tool_stream import ToolOutputReader
from server.tools import read_output

CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", '
    '"unit": "celsius", "nested": {"a": [1, {"b": "}]"}]}}}, '
    '{"name":"get_time","arguments":{"zone":"CET"}}]}'
)
ANSWER = '{"response": "line\\nquote \\" slash \\\\ u-escape \\u00e9 pair \\ud83d\\ude00 end\\\\"}'
SWAPPED = '{"tool_calls": [{"arguments": {"x": 1}, "name": "f"}]}'


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(pieces: list[str]) -> tuple[dict[int, dict], str]:
    reader, calls, content = ToolOutputReader(), {}, ""
    for piece in pieces:
        reader.feed(piece)
        for index, call, first, new in reader.take_calls():
            if first:
                assert index not in calls  # announced once, with its whole name
                calls[index] = {"id": call.id, "name": call.name, "arguments": ""}
            calls[index]["arguments"] += new
        text = reader.take_content()
        assert not any("\ud800" <= ch <= "\udfff" for ch in text)  # no half pairs
        content += text
    return calls, content


@pytest.mark.parametrize("seed", range(25))
def test_calls_stream_whole_for_any_split(seed):
    pieces = splits(CALLS, seed) if seed else list(CALLS)  # seed 0: a character at a time
    calls, content = stream(pieces)
    assert content == ""
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    want = [c["arguments"] for c in json.loads(CALLS)["tool_calls"]]
    assert [json.loads(calls[i]["arguments"]) for i in sorted(calls)] == want
    _, read = read_output(CALLS)
    assert read is not None
    assert [c.function.arguments for c in read] == [calls[i]["arguments"] for i in sorted(calls)]
    assert read[1].function.arguments == '{"zone":"CET"}'  # raw text, as the model wrote it


@pytest.mark.parametrize("seed", range(25))
def test_answer_text_streams_decoded_for_any_split(seed):
    pieces = splits(ANSWER, seed) if seed else list(ANSWER)
    calls, content = stream(pieces)
    assert calls == {}
    assert content == json.loads(ANSWER)["response"] == read_output(ANSWER)[0]


def test_a_call_waits_for_its_name_and_a_cut_output_stays_readable():
    reader = ToolOutputReader()
    reader.feed(SWAPPED[: SWAPPED.index('"name"')])  # arguments whole, name not yet
    assert reader.take_calls() == []
    reader.feed(SWAPPED[SWAPPED.index('"name"') :])
    ((index, call, first, new),) = reader.take_calls()
    assert (index, call.name, first, json.loads(new)) == (0, "f", True, {"x": 1})
    cut = ToolOutputReader()  # cut by max_tokens inside the arguments
    cut.feed(CALLS[:60])
    ((_, call, _, new),) = cut.take_calls()
    assert call.args_end is None and CALLS[:60].endswith(new)
    content, read = read_output(CALLS[:60])  # the non-streamed answer has the same cut call
    assert content is None and read is not None and read[0].function.arguments == new
    early = CALLS[: CALLS.index("get_weather") + 3]  # cut inside the first name: nothing read
    assert read_output(early) == (early, None)  # the whole text, as content
    assert read_output(ANSWER[:40]) == (json.loads(ANSWER[:40] + '"}')["response"], None)
