"""The ablation's other data: ShareGPT's own first answers (written by other models), in the
same record format as the self-distillation (train/distill.py), ``<out>/<split>-original.jsonl``.
The head then learns the target's distribution on text the target did not write."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, cast

from prompts.sharegpt import first_exchanges


def run(args: argparse.Namespace) -> None:
    from engine.config import DEFAULT_TARGET
    from engine.model.loader import load_model
    from prompts.sets import Prompt, encode

    _, tok = load_model(DEFAULT_TARGET, "bfloat16")
    tok = cast(Any, tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
