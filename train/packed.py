"""Training rows packed small enough to travel to a lent GPU (scripts/gpu_train_pack.py).

A packed file (``.npz``, compressed) holds three arrays:

* ``tokens`` ``[T]`` uint16: every row's token ids, one row after another (the targets served
  here have vocabularies under 65,536 ids; a larger id is refused when packing);
* ``offsets`` ``[N + 1]`` int64: row ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``;
* ``starts`` ``[N]`` int32: where row ``i``'s learned part begins (its prompt's length), as
  ``Row.start``.

About a byte a token on ShareGPT's conversations against ~5 in JSON lines; ``read_rows`` reads
both.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .batches import Row


def save_rows(path: str | Path, rows: Iterable[tuple[list[int], int]]) -> tuple[int, int]:
    """Write ``(ids, start)`` pairs to ``path``; returns (rows, tokens) written."""
    chunks: list[np.ndarray] = []
    offsets, starts = [0], []
    for ids, start in rows:
        a = np.asarray(ids, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= 1 << 16):
            raise ValueError("a token id outside uint16: this format cannot hold it")
        chunks.append(a.astype(np.uint16))
        offsets.append(offsets[-1] + a.size)
        starts.append(start)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)
    with open(path, "wb") as f:  # a file object: numpy would append .npz to a str path
        np.savez_compressed(
            f,
            tokens=tokens,
            offsets=np.asarray(offsets, np.int64),
            starts=np.asarray(starts, np.int32),
        )
    return len(starts), int(tokens.size)


def load_rows(path: str | Path, max_len: int, limit: int = 0) -> list[Row]:
    """The rows of a packed file cut at ``max_len`` tokens, keeping (as ``read_rows`` does) only
    rows with at least one learned position left."""
    with np.load(path) as z:
        tokens, offsets, starts = z["tokens"], z["offsets"], z["starts"]
    rows = []
    for i, start in enumerate(starts.tolist()):
        lo = int(offsets[i])
        hi = min(int(offsets[i + 1]), lo + max_len)
        if start + 1 < hi - lo:
            rows.append(Row(tokens[lo:hi].astype(np.int64).tolist(), start))
            if limit and len(rows) >= limit:
                break
    return rows


def load_prompts(path: str | Path, max_prompt: int) -> list[tuple[str, list[int]]]:
    """``(id, prompt ids)`` of a packed file's rows (each row's ``ids[:start]``, named by its
    index) whose prompt is at most ``max_prompt`` tokens: prompts for the self-distillation where
    the data set is not installed (a lent GPU)."""
    with np.load(path) as z:
        tokens, offsets, starts = z["tokens"], z["offsets"], z["starts"]
    out = []
    for i, start in enumerate(starts.tolist()):
        if 0 < start <= max_prompt:
            lo = int(offsets[i])
            out.append((f"row{i}", tokens[lo : lo + start].astype(np.int64).tolist()))
    return out
