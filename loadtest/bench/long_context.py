"""Decoding after a long prompt: specd against llama.cpp's llama-server, one run.

After ~6,000 tokens of prompt the K/V a decoded token attends over outweighs the weights it
reads, so this is where the attention kernels show. The prompts: ``--prompts`` ShareGPT
conversations of the evaluation bucket (``e``, prompts/sharegpt.py's split) grown to about
``--tokens`` tokens of history with other ``e`` conversations' turns, ending in a user turn (as
loadtest/bench/multiturn.py's long runs), and as many short first turns of other ``e``
conversations (the decode speed with an almost empty cache, for scale). Each request asks for
``--max-tokens`` greedy tokens with ``ignore_eos`` (both servers decode the same number),
streamed, one request at a time.

Per server, alone (the other stopped: they would share the cores), warmed with one short request:

- ``specd``: ``specd serve --config CONFIG --max-model-len 8192``, each prompt sent with
  speculation on (the config's drafter) and off (``"speculation": {"enabled": false}``), the
  order alternating prompt by prompt;
- ``llama-server``: llama.cpp's native server on the config's GGUF, ``-t 2 -tb 2 -c 8192 -np 1``
  (one slot of 8,192 tokens).

Each prompt is sent twice in a row in every mode. Its first send on a server is a cold prefill
(its TTFT is the prefill's time; with specd's two modes alternating, each mode has the cold send
of every other prompt); the others may be served from the server's prompt cache. Decode tok/s
counts the tokens after the first over the time from the first streamed content to the last
(the prefill excluded), the median over every send.

    python -m loadtest.bench.long_context \\
        --llama-server loadtest/envs/llama-server/build/bin/llama-server \\
        --out loadtest/results/long_context.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.model.loader import resolve_source
from loadtest.bench.multiturn import chunks, dialogues, grown, turn
from loadtest.machine import cpu_description
from loadtest.server_proc import HOST, spawn, specd_argv


def messages(history: list[tuple[str, str]], user: str) -> list[dict]:
    out = []
    for u, a in history:
        out += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return out + [{"role": "user", "content": user}]


def send(base: str, model: str, msgs: list[dict], max_tokens: int, extra: dict) -> dict:
    """One streamed chat request with ignore_eos: TTFT, decode tok/s after the first token,
    usage."""
    r = turn(base, model, msgs, max_tokens, {"ignore_eos": True, **extra})
    if r["last_s"] <= r["ttft_s"]:
        raise RuntimeError("fewer than two streamed contents: no decode speed")
    return {
        "ttft_s": r["ttft_s"],
        "decode_tok_s": (r["completion_tokens"] - 1) / (r["last_s"] - r["ttft_s"]),
        "completion_tokens": r["completion_tokens"],
        "prompt_tokens": r["prompt_tokens"],
        "cached_tokens": r["cached_tokens"],
    }


@contextmanager
def server(name: str, args, log: Path):
    cfg = EngineConfig.from_yaml(args.config)
    if name == "specd":
        argv = specd_argv(args.config) + ["--max-model-len", "8192"]
        env = {"HF_HUB_OFFLINE": "1", "SPECD_LOG_LEVEL": "warning"}
        with spawn(argv, ready_path="/ready", name=name, env=env, log=log) as s:
            yield s.url, cfg.model.name
        return
    gguf = resolve_source(cfg.model.source).location
    argv = [args.llama_server, "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "8192", "-np", "1"]
    argv += ["--host", HOST, "--port", "0"]
    with spawn(argv, ready_path="/health", name=name, log=log) as s:
        models = httpx.get(f"{s.url}/v1/models", timeout=30).json()["data"]
        yield s.url, models[0]["id"]


def run(base: str, model: str, prompts: list[list[dict]], modes: dict, max_tokens: int) -> dict:
    """Every prompt twice in every mode, the modes' order alternating by prompt; a send is
    ``cold`` when it is the prompt's first on this server (the later ones, in any mode, may
    be served from its prompt cache)."""
    out: dict = {m: [] for m in modes}
    for i, msgs in enumerate(prompts):
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for j, m in enumerate(order):
            for k in range(2):
                r = send(base, model, msgs, max_tokens, modes[m])
                out[m].append({**r, "cold": j == 0 and k == 0})
    return out


def summary(rows: list[dict]) -> dict:
    """A mode's medians: decode tok/s over every send, prefill time (TTFT) and cached tokens
    over its cold sends, cached tokens over the others."""
    med = statistics.median
    cold = [r for r in rows if r["cold"]]
    warm = [r for r in rows if not r["cold"]]
    return {
        "decode_tok_s": med(r["decode_tok_s"] for r in rows),
        "prefill_s": med(r["ttft_s"] for r in cold) if cold else float("nan"),
        "prompt_tokens": med(r["prompt_tokens"] or 0 for r in rows),
        "cached_tokens_cold": med(r["cached_tokens"] or 0 for r in cold) if cold else 0,
        "cached_tokens_warm": med(r["cached_tokens"] or 0 for r in warm),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.long_context", description=__doc__)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=6000, help="the long prompts' size, about")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--out", default=None, help="write the table here too")
    a = ap.parse_args(argv)
    n = a.prompts
    parts = zip(dialogues(n, 1, max_chars=3000), chunks(dialogues(40 * n, 1, skip=n), n))
    grown_ = [grown(pairs, filler, a.tokens) for pairs, filler in parts]
    long = [messages(history, pairs[0][0]) for history, pairs in grown_]
    short = [messages([], p[0][0]) for p in dialogues(n, 1, skip=41 * n, max_chars=2000)]
    warm = messages([], dialogues(1, 1, skip=42 * n, max_chars=2000)[0][0][0])
    names = ["specd"] + (["llama-server"] if a.llama_server else [])
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="long-context-") as tmp:
        for name in names:
            modes = (
                {"specd": {}, "specd spec off": {"speculation": {"enabled": False}}}
                if name == "specd"
                else {"llama-server": {}}
            )
            with server(name, a, Path(tmp) / f"{name}.log") as (base, model):
                send(base, model, warm, 16, {})
                for label, prompts in (("long", long), ("short", short)):
                    for m, rows in run(base, model, prompts, modes, a.max_tokens).items():
                        results[(m, label)] = summary(rows)
                        print(m, label, results[(m, label)], flush=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    setup = (
        f"# {n} long prompts (~{a.tokens} tokens of ShareGPT e history) and {n} short ones, "
        f"{a.max_tokens} greedy tokens each with ignore_eos, streamed, one at a time; each sent "
        "twice in every mode (a prompt's first send on a server is cold, the rest may hit its "
        "prompt cache); decode tok/s: the tokens after the first over first-to-last content "
        "(median of every send); prefill: the cold sends' TTFT (median)."
    )
    columns = "mode".ljust(16) + "".join(
        h.rjust(w)
        for h, w in (("prompt", 8), ("tokens", 8), ("decode tok/s", 14), ("prefill s", 11))
    )
    columns += "cached cold".rjust(13)
    lines = [
        f"# python -m loadtest.bench.long_context {command}",
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {cpu_description()}",
        setup,
        columns + "cached warm".rjust(13),
    ]
    for (m, label), r in results.items():
        lines.append(
            f"{m:16}{label:>8}{r['prompt_tokens']:>8.0f}{r['decode_tok_s']:>14.1f}"
            f"{r['prefill_s']:>11.2f}{r['cached_tokens_cold']:>13.0f}{r['cached_tokens_warm']:>13.0f}"
        )
    lines.append("")
    for m in [m for m, label in results if label == "long"]:
        long_r, short_r = results[(m, "long")], results[(m, "short")]
        lines.append(
            f"{m}: decode after the long prompt / after a short one "
            f"{long_r['decode_tok_s'] / short_r['decode_tok_s']:.2f}x"
        )
    if ("llama-server", "long") in results:
        ref = results[("llama-server", "long")]
        for m in ("specd", "specd spec off"):
            r = results[(m, "long")]
            lines.append(
                f"{m} / llama-server after the long prompt: decode "
                f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x, prefill time "
                f"{r['prefill_s'] / ref['prefill_s']:.2f}x"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
