"""ShareGPT's own text as training rows, in the record format of the self-distillation
(train/distill.py): the loss is the target's distribution on text the target did not write.

* default: each conversation's first answer, ``<out>/<split>-original.jsonl``;
* ``--whole``: the whole conversation in the chat template, the first user turn as the prompt
  and every later turn (the assistant's and the user's) as the learned part, cut at
  ``--max-len`` tokens, packed (train/packed.py) as ``<out>/<split>-conversations.npz``. The
  labels are the target's own distribution at every position (soft labels), so a user turn
  teaches the head the target as well as an answer does; this is the most text the data set
  holds (~25 M tokens in the training buckets against ~3 M of first answers).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from prompts.sharegpt import conversations, first_exchanges

ROLES = {"human": "user", "gpt": "assistant"}


def messages_of(conv: dict) -> list[dict[str, str]] | None:
    """A ShareGPT conversation as chat messages, or None unless it alternates user / assistant
    from a user turn, every turn non-empty, with at least one answer."""
    out = []
    for i, turn in enumerate(conv.get("conversations") or []):
        role, text = ROLES.get(turn.get("from", "")), turn.get("value") or ""
        if role != ("user" if i % 2 == 0 else "assistant") or not text.strip():
            return None
        out.append({"role": role, "content": text})
    return out if len(out) >= 2 else None


def whole_rows(tok, split: str, max_prompt: int, max_len: int) -> Iterator[tuple[list[int], int]]:
    """``(ids, start)`` of each usable conversation of ``split``: ``ids[:start]`` is its first
    user turn as the server encodes a chat prompt, the rest its later turns."""
    from prompts.sets import Prompt, chat_ids, encode

    for conv in conversations(split):
        msgs = messages_of(conv)
        if msgs is None:
            continue
        prompt = encode(tok, Prompt(conv["id"], "sharegpt", "chat", msgs[0]["content"]))
        if len(prompt) > max_prompt:
            continue
        ids = chat_ids(tok, msgs, add_generation_prompt=False)
        if ids[: len(prompt)] != prompt:  # the template did not extend the prompt: skip it
            continue
        yield ids[:max_len], len(prompt)


def run(args: argparse.Namespace) -> None:
    from engine.config import DEFAULT_TARGET
    from engine.model.loader import load_model
    from prompts.sets import Prompt, encode

    _, tok = load_model(DEFAULT_TARGET, "bfloat16")
    tok = cast(Any, tok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.whole:
        from itertools import islice

        from .packed import save_rows

        rows = whole_rows(tok, args.split, args.max_prompt, args.max_len)
        path = out / f"{args.split}-conversations.npz"
        n, tokens = save_rows(path, islice(rows, args.limit or None))
        print(f"{n} conversations, {tokens} tokens, {path.stat().st_size / 2**20:.1f} MiB")
        return
    end = tok.convert_tokens_to_ids("<|im_end|>")
    n = 0
    with open(out / f"{args.split}-original.jsonl", "w") as f:
        for conv_id, text, answer in first_exchanges(args.split):
            ids = encode(tok, Prompt(conv_id, "sharegpt", "chat", text))
            if len(ids) > args.max_prompt or not answer.strip():
                continue
            output = tok(answer, add_special_tokens=False)["input_ids"][: args.max_tokens]
            if len(output) < args.max_tokens:
                output = output + [end]
            row = {"id": conv_id, "temperature": None, "prompt_ids": ids, "output_ids": output}
            f.write(json.dumps(row) + "\n")
            n += 1
            if args.limit and n >= args.limit:
                break
    print(f"{n} conversations")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--split", default="train", choices=["train", "eval"])
    ap.add_argument("--out", default=".cache/distill")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--whole", action="store_true", help="whole conversations, packed")
    ap.add_argument("--max-len", type=int, default=2048, help="with --whole: tokens a row")
