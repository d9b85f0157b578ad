"""Multi-turn conversations replayed as chat clients send them: every turn resends the history.

Conversations from ShareGPT's evaluation bucket (``e``; prompts/sharegpt.py's split, which never
returns the reserved ``f``): the first ``--turns`` user turns of conversations that have that
many, the data set's own assistant answers in the history, so every server is sent the same
prompts whatever it answers (``--history own``: each server's own answers instead, as a chat
client resends them: a prefix cache then holds every token but the new user turn's). Each turn
asks for ``--max-tokens`` greedy tokens, streamed.

Runs, each server alone (the others stopped: they would share the cores):

- ``--conversations`` conversations one at a time, then the same ones ``--concurrency`` at once;
- ``--long`` conversations whose history is grown to about ``--long-tokens`` tokens before their
  turns (the e bucket's conversations joined, in order);

Servers: ``specd`` (the config as given: prefix cache on), ``specd-nocache``
(``--no-enable-prefix-caching``) and, with ``--llama-server PATH``, llama.cpp's native server on
the config's GGUF (2 threads, 8 slots of 8,192 tokens, its prompt cache on: its default).
Reported per server and run: the median TTFT of each turn, output tok/s (completion tokens over
the run's wall time), and specd's prompt and cached tokens per turn (its usage). A first run of
the conversations' first turns alone (one at a time and at once) prices the cache where it
cannot hit: specd against specd-nocache.

    loadtest/envs/build_llama_server.sh     # prints the binary's path
    python -m loadtest.bench.multiturn --llama-server PATH
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.model.loader import resolve_source
from loadtest.server_proc import HOST, spawn, specd_argv
from prompts.sharegpt import EVAL, conversations

CHARS_PER_TOKEN = 4  # English text in SmolLM2's tokenizer, about (sizes the long histories)


def dialogues(
    count: int, turns: int, skip: int = 0, max_chars: int = 12000
) -> list[list[tuple[str, str]]]:
    """``count`` conversations of the e bucket with at least ``turns`` (user, assistant) pairs
    whose first ``turns`` pairs hold at most ``max_chars`` characters (the context's room):
    those pairs."""
    out: list[list[tuple[str, str]]] = []
    for conv in conversations(EVAL):
        msgs = conv.get("conversations") or []
        pairs = []
        for u, a in zip(msgs[::2], msgs[1::2]):
            if u.get("from") != "human" or a.get("from") != "gpt":
                break
            if not (u.get("value") or "").strip():
                break
            pairs.append((u["value"], a.get("value") or ""))
        if len(pairs) >= turns and sum(len(u) + len(a) for u, a in pairs[:turns]) <= max_chars:
            if skip:
                skip -= 1
                continue
            out.append(pairs[:turns])
            if len(out) == count:
                break
    return out


def grown(base: list[tuple[str, str]], filler: list[list[tuple[str, str]]], tokens: int):
    """``base``'s turns after a history of ``filler``'s pairs of about ``tokens`` tokens."""
    history: list[tuple[str, str]] = []
    size = 0
    for conv in filler:
        for pair in conv:
            if size >= tokens * CHARS_PER_TOKEN:
                return history, base
            history.append(pair)
            size += len(pair[0]) + len(pair[1])
    return history, base


def turn(
    base: str, model: str, messages: list[dict], max_tokens: int, extra: dict | None = None
) -> dict:
    """One streamed chat request (``extra``: more fields of its body): TTFT and the time to the
    last content, completion tokens, usage."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    t0 = time.perf_counter()
    ttft = last = None
    chunks, usage, text = 0, None, []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for c in event.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    text.append(c["delta"]["content"])
                    chunks += 1
                    last = time.perf_counter() - t0
                    ttft = last if ttft is None else ttft
    done = time.perf_counter() - t0
    tokens = (usage or {}).get("completion_tokens") or chunks
    details = (usage or {}).get("prompt_tokens_details") or {}
    spec = (usage or {}).get("speculation") or {}  # specd's: drafted and accepted tokens
    return {
        "drafted": spec.get("drafted_tokens", 0),
        "accepted": spec.get("accepted_tokens", 0),
        "ttft_s": ttft if ttft is not None else done,
        "last_s": last if last is not None else done,  # the last content's arrival
        "s": done,
        "completion_tokens": tokens,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "text": "".join(text),
    }


def chunks(items: list, k: int) -> list[list]:
    """``items`` dealt into ``k`` lists."""
    return [items[i::k] for i in range(k)]


def replay(base: str, model: str, history, pairs, max_tokens: int, own: bool) -> list[dict]:
    """One conversation: each turn sends ``history``, the earlier pairs and the next user turn
    (``own``: the earlier turns' answers are the server's, else the data set's)."""
    msgs = []
    for u, a in history:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    out = []
    for u, a in pairs:
        msgs.append({"role": "user", "content": u})
        out.append(turn(base, model, list(msgs), max_tokens))
        msgs.append({"role": "assistant", "content": out[-1]["text"] if own else a})
    return out


def measure(
    base: str, model: str, convs, concurrency: int, max_tokens: int, own: bool = False
) -> dict:
    """Every conversation of ``convs`` ((history, pairs) each), ``concurrency`` at once."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda c: replay(base, model, c[0], c[1], max_tokens, own), convs))
    wall = time.perf_counter() - t0
    turns = len(runs[0])
    by_turn = [[r[t] for r in runs] for t in range(turns)]
    med = statistics.median
    return {
        "concurrency": concurrency,
        "conversations": len(convs),
        "ttft_ms_by_turn": [med(x["ttft_s"] for x in ts) * 1e3 for ts in by_turn],
        "prompt_tokens_by_turn": [med(x["prompt_tokens"] or 0 for x in ts) for ts in by_turn],
        "cached_tokens_by_turn": [med(x["cached_tokens"] or 0 for x in ts) for ts in by_turn],
        "output_tok_s": sum(x["completion_tokens"] for r in runs for x in r) / wall,
        # drafted tokens accepted, by turn (specd): a cache hit must not cost acceptance
        "acceptance_by_turn": [
            sum(x["accepted"] for x in ts) / max(1, sum(x["drafted"] for x in ts)) for ts in by_turn
        ],
        "wall_s": wall,
    }


@contextmanager
def server(name: str, args, out: Path):
    if name.startswith("specd"):
        argv = specd_argv(args.config)
        if name == "specd-nocache":
            argv.append("--no-enable-prefix-caching")
        argv += ["--max-model-len", str(args.max_model_len)]
        env = {"HF_HUB_OFFLINE": "1", "SPECD_LOG_LEVEL": "warning"}
        with spawn(argv, ready_path="/ready", name=name, env=env, log=out / f"{name}.log") as s:
            yield s.url, EngineConfig.from_yaml(args.config).model.name
        return
    gguf = resolve_source(EngineConfig.from_yaml(args.config).model.source).location
    # -c is shared by the slots: 8 slots of SmolLM2's whole context
    argv = [args.llama_server, "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "65536", "-np", "8"]
    argv += ["--host", HOST, "--port", "0"]
    with spawn(argv, ready_path="/health", name=name, log=out / f"{name}.log") as s:
        yield s.url, "smollm2"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.multiturn", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--long", type=int, default=2, help="conversations grown to --long-tokens")
    ap.add_argument("--long-tokens", type=int, default=5400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--servers", default="specd,specd-nocache,llama-server")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--out", default="loadtest/results/multiturn")
    ap.add_argument(
        "--history",
        choices=["dataset", "own"],
        default="dataset",
        help="the earlier answers resent: the data set's, or each server's own",
    )
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # every run its own conversations: one never hits another's prefixes
    n, t = a.conversations, a.turns
    alone = [([], pairs) for pairs in dialogues(n, t)]
    together = [([], pairs) for pairs in dialogues(n, t, skip=n)]
    long = [
        grown(pairs, filler, a.long_tokens)
        for pairs, filler in zip(
            dialogues(a.long, t, skip=2 * n, max_chars=6000),
            chunks(dialogues(30 * a.long, 1, skip=2 * n + a.long, max_chars=4000), a.long),
        )
    ]
    firsts = [([], p[:1]) for p in dialogues(2 * n, 1, skip=2 * n + 31 * a.long)]
    names = [n for n in a.servers.split(",") if n != "llama-server" or a.llama_server]
    results: dict = {"args": vars(a), "servers": {}}
    for name in names:
        with server(name, a, out) as (base, model):
            warm = [([], p) for p in dialogues(2, 1, skip=2 * n + 31 * a.long + 2 * n)]
            measure(base, model, warm, 1, 8)  # first requests after start-up
            own = a.history == "own"
            runs = [
                measure(base, model, alone, 1, a.max_tokens, own),
                measure(base, model, together, a.concurrency, a.max_tokens, own),
                measure(base, model, long, 1, a.max_tokens, own),
                measure(base, model, firsts[:n], 1, a.max_tokens),
                measure(base, model, firsts[n:], a.concurrency, a.max_tokens),
            ]
        results["servers"][name] = runs
        labels = ("one at a time", f"{a.concurrency} at once", "long", "first turns", "first x8")
        for r, label in zip(runs, labels):
            ttft = ", ".join(f"{t:.0f}" for t in r["ttft_ms_by_turn"])
            print(
                f"{name:14s} {label:14s} TTFT by turn (ms) {ttft}; "
                f"{r['output_tok_s']:.1f} tok/s; prompt tokens {r['prompt_tokens_by_turn']}, "
                f"cached {r['cached_tokens_by_turn']}; acceptance by turn "
                f"{[round(x, 3) for x in r['acceptance_by_turn']]}",
                flush=True,
            )
        (out / "results.json").write_text(json.dumps(results, indent=1))
    ratios(results["servers"])
    return 0


def ratios(servers: dict) -> None:
    """The targets' ratios, from this run: TTFT at the last turn over the first, and the long
    conversations' last-turn TTFT and the first turns' tok/s against the other servers."""
    for name, (one, many, *_) in servers.items():
        t = one["ttft_ms_by_turn"]
        print(
            f"{name}: TTFT last turn / first turn {t[-1] / t[0]:.2f}x (one at a time), "
            f"{many['ttft_ms_by_turn'][-1] / many['ttft_ms_by_turn'][0]:.2f}x (at once)"
        )
    for other in [n for n in servers if n != "specd"]:
        if "specd" not in servers:
            break
        a, b = servers["specd"], servers[other]
        print(
            f"specd / {other}: long conversation, last-turn TTFT "
            f"{a[2]['ttft_ms_by_turn'][-1] / b[2]['ttft_ms_by_turn'][-1]:.2f}x; conversations' "
            f"output tok/s {a[0]['output_tok_s'] / b[0]['output_tok_s']:.2f}x (one at a time), "
            f"{a[1]['output_tok_s'] / b[1]['output_tok_s']:.2f}x (at once); first turns' tok/s "
            f"{a[3]['output_tok_s'] / b[3]['output_tok_s']:.2f}x (one at a time), "
            f"{a[4]['output_tok_s'] / b[4]['output_tok_s']:.2f}x (at once)"
        )


if __name__ == "__main__":
    sys.exit(main())
