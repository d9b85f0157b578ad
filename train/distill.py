"""Self-distillation: regenerate the assistant turns of ShareGPT prompts with the target itself,
through specd's own batched engine, so the drafter learns the model it will serve.

Each prompt is the first human turn of a conversation (prompts/sharegpt.py), in the target's chat
template; half the conversations (by id) are answered greedily, half sampled at temperature
``temperature``. Results are appended to ``<out>/<split>.jsonl`` one line per conversation as it
finishes, so a run can stop at any time and resume (conversations already written are skipped);
``<out>/<split>.stats.json`` records tokens generated and wall time over all runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from prompts.sharegpt import first_turns


def _sampled(conv_id: str) -> bool:
    """Whether this conversation is answered sampled (else greedy): half of them, by id."""
    return hashlib.sha256(("distill:" + conv_id).encode()).digest()[0] % 2 == 1


def by_length_windows(items: list, window: int) -> list:
    """``items`` (``(id, ids, ...)``) sorted by prompt length within consecutive windows of
    ``window``: the rows decoded together have similar lengths (attention reads every row's
    keys up to the longest row's), while the order over the file is kept."""
    out = []
    for i in range(0, len(items), window):
        out += sorted(items[i : i + window], key=lambda item: len(item[1]))
    return out


def still_to_answer(
    turns: Iterable[tuple[str, str]],
    done: set[str],
    encode: Callable[[str, str], list[int]],
    max_prompt: int,
    limit: int,
    offset: int = 0,
) -> list[tuple[str, list[int], bool]]:
    """``(id, prompt ids, sampled)`` of the conversations not answered yet, in the file's order
    (``turns``: (id, text) and ``encode`` its ids; or (id, ids) and ``encode`` returning them),
    prompts of at most ``max_prompt`` tokens. The first ``offset`` such prompts (answered or not)
    are passed over: an earlier run's fit already learned them. ``limit`` (0: none) counts the
    answered ones too: a split already holding ``limit`` answers gets no more."""
    found: list[tuple[str, list[int], bool]] = []
    eligible = 0
    for conv_id, text in turns:
        if limit and len(found) + len(done) >= limit:
            break
        if eligible >= offset and conv_id in done:
            continue  # past the offset an answered prompt needs no encoding
        ids = encode(conv_id, text)
        if len(ids) > max_prompt:
            continue
        eligible += 1
        if eligible > offset and conv_id not in done:
            found.append((conv_id, ids, _sampled(conv_id)))
    return found


def load_done(path: Path) -> set[str]:
    if not path.exists():
        return set()
    done = set()
    with open(path) as f:
        for line in f:
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                continue  # a line cut by a kill
    return done


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from engine.builder import build_engine
    from engine.config import EngineConfig
    from engine.records.params import SamplingParams, SpecParams
    from prompts.sets import Prompt, encode

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path, stats_path = out / f"{args.split}.jsonl", out / f"{args.split}.stats.json"
    cfg = EngineConfig.from_dict(
        {
            "model": {"dtype": args.dtype, "native_q4": args.native_q4, "device": args.device},
            "drafter": {"method": "none"},
            "max_running": args.batch,
            "max_model_len": args.max_prompt + args.max_tokens + 1,
            "max_prefill_per_step": 4,
            "threads": args.threads,
            "compile": {"enabled": args.compile, "q_buckets": [1]},
        }
    )
    built = build_engine(cfg)
    if built.engine.needs_warm_up():
        built.engine.warm_up()
    engine, tok = built.engine, cast(Any, built.tokenizer)
    done = load_done(path)
    if args.prompts:  # packed rows' prompts (train/packed.py), where the data set is not installed
        from .packed import load_prompts

        turns: Iterable[tuple[str, Any]] = load_prompts(args.prompts, args.max_prompt)

        def to_ids(conv_id: str, text: Any) -> list[int]:  # the packed prompts: ids already
            return text

    else:
        turns = first_turns(args.split)

        def to_ids(conv_id: str, text: Any) -> list[int]:
            return encode(tok, Prompt(conv_id, "sharegpt", "chat", text))

    found = still_to_answer(turns, done, to_ids, args.max_prompt, args.limit, args.offset)
    todo = deque(by_length_windows(found, 8 * args.batch))
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    tokens, seconds = stats.get("output_tokens", 0), stats.get("seconds", 0.0)
    inflight: dict[str, tuple[str, list[int], float]] = {}
    bar = tqdm(total=len(todo), desc=f"distill {args.split}", unit="conv")
    t_last = t_start = time.perf_counter()
    deadline = t_start + args.minutes * 60 if args.minutes else float("inf")
    with open(path, "a") as f:
        while todo or engine.has_work():
            if time.perf_counter() > deadline:  # unfinished answers are redone on resume
                break
            while todo and len(inflight) < 2 * args.batch:
                conv_id, ids, sampled = todo.popleft()
                temp = args.temperature if sampled else 0.0
                params = SamplingParams(temperature=temp, max_tokens=args.max_tokens)
                engine.add_request(conv_id, ids, params, SpecParams(enabled=False))
                inflight[conv_id] = (conv_id, ids, temp)
            for o in engine.step():
                if not o.finished or o.seq is None:
                    continue
                _, ids, temp = inflight.pop(o.request_id)
                row = {
                    "id": o.request_id,
                    "temperature": temp,
                    "prompt_ids": ids,
                    "output_ids": list(o.seq.output_ids),
                    "finish": o.finish_reason,
                }
                f.write(json.dumps(row) + "\n")
                f.flush()
                tokens += len(o.seq.output_ids)
                bar.update(1)
                bar.set_postfix(tokens=tokens)
            now = time.perf_counter()
            if now - t_last > 30:  # keep the stats current for a run that gets killed
                seconds += now - t_last
                t_last = now
                stats_path.write_text(json.dumps({"output_tokens": tokens, "seconds": seconds}))
    seconds += time.perf_counter() - t_last
    stats_path.write_text(json.dumps({"output_tokens": tokens, "seconds": seconds}))
    bar.close()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--split", default="train", choices=["train", "eval"])
    ap.add_argument("--out", default=".cache/distill")
    ap.add_argument("--limit", type=int, default=0, help="stop after this many conversations")
    ap.add_argument("--minutes", type=float, default=0, help="stop after this long (0: no limit)")
    ap.add_argument(
        "--offset", type=int, default=0, help="pass over the first N short-enough prompts"
    )
    ap.add_argument("--batch", type=int, default=32, help="sequences decoded together")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda where a GPU is lent")
    ap.add_argument("--native-q4", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="compiled decode steps (warm-up first)")
    ap.add_argument(
        "--prompts",
        default=None,
        help="the prompts of a packed rows file (train/packed.py) instead of the data set's "
        "first turns of --split (the rows must come from that split)",
    )
