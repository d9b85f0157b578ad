"""Packed training rows (train/packed.py) and the other files ``read_rows`` takes."""

import gzip
import json

import pytest

from train.batches import read_rows
from train.packed import load_rows, save_rows


def records(n: int = 5) -> list[dict]:
    return [
        {"id": str(i), "prompt_ids": list(range(10 + i)), "output_ids": [7 + i] * (3 + 4 * i)}
        for i in range(n)
    ]


def test_packed_jsonl_and_gzipped_rows_read_alike(tmp_path):
    recs = records()
    with open(tmp_path / "a.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as g:
        g.writelines(json.dumps(r) + "\n" for r in recs)
    pairs = [(r["prompt_ids"] + r["output_ids"], len(r["prompt_ids"])) for r in recs]
    n, tokens = save_rows(tmp_path / "a.npz", pairs)
    assert n == 5 and tokens == sum(len(r["prompt_ids"]) + len(r["output_ids"]) for r in recs)
    for max_len, limit in ((1000, 0), (15, 0), (1000, 2)):
        want = read_rows(tmp_path / "a.jsonl", max_len, limit)
        assert want  # rows were read, cut at max_len, rows left with nothing to learn dropped
        assert read_rows(tmp_path / "a.jsonl.gz", max_len, limit) == want
        assert read_rows(tmp_path / "a.npz", max_len, limit) == want
    cut = read_rows(tmp_path / "a.npz", 15)
    assert all(len(r.ids) <= 15 and r.start + 1 < len(r.ids) for r in cut)
    assert len(cut) < len(read_rows(tmp_path / "a.npz", 1000))  # some had nothing left to learn


def test_an_id_outside_uint16_is_refused(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        save_rows(tmp_path / "b.npz", [([1, 2, 70000], 1)])
    save_rows(tmp_path / "c.npz", [([0, 65535, 3], 1)])
    assert load_rows(tmp_path / "c.npz", 10)[0].ids == [0, 65535, 3]


def test_the_prompts_of_packed_rows_are_their_first_turns(tmp_path):
    from train.packed import load_prompts

    save_rows(tmp_path / "p.npz", [([1, 2, 3, 4], 2), ([5, 6, 7, 8, 9, 10], 5), ([11, 12], 1)])
    assert load_prompts(tmp_path / "p.npz", 4) == [("row0", [1, 2]), ("row2", [11])]
    assert [i for i, _ in load_prompts(tmp_path / "p.npz", 5)] == ["row0", "row1", "row2"]
