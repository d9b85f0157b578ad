import pytest

from server.textstream import IncrementalDetokenizer, StopFilter


@pytest.fixture(scope="module")
def tok(real_fp32):
    return real_fp32[1]


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! Ünïcödé — 日本語のテキスト and emoji 🎉🚀 mixed in.",
        "def f(x):\n    return x ** 2  # squares\n\n\tindent",
        "  leading spaces and trailing  ",
    ],
)
@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_equals_full_decode(tok, text, chunk):
    ids = tok(text)["input_ids"]
    prompt = tok("Some prompt:")["input_ids"]
    d = IncrementalDetokenizer(tok, prompt)
    out = []
    for i in range(0, len(ids), chunk):
        piece = d.add(ids[i : i + chunk], final=i + chunk >= len(ids))
        assert "\ufffd" not in piece
        out.append(piece)
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_not_rendered(tok):
    d = IncrementalDetokenizer(tok)
    ids = tok("Hi there")["input_ids"] + [tok.eos_token_id]
    assert d.add(ids, final=True) == "Hi there"


def feed_all(f, pieces):
    out = [f.feed(p) for p in pieces]
    out.append(f.feed("", final=True))
    return "".join(out)


def test_stop_spanning_chunks_never_leaks():
    f = StopFilter(["STOP"])
    sent = [f.feed(p) for p in ["abc S", "T", "OP tail"]]
    assert "".join(sent) == "abc " and f.stopped
    assert all("S" not in s for s in sent[1:])


def test_earliest_stop_wins_and_no_stop_flushes():
    f = StopFilter(["xyz", "b"])
    assert feed_all(f, ["aaxy", "zb"]) == "aa"
    f = StopFilter(["###"])
    assert feed_all(f, ["one #", "# two #"]) == "one ## two #" and not f.stopped


def test_no_stops_passes_through():
    f = StopFilter([])
    assert f.feed("abc") == "abc" and f.feed("d") == "d"
