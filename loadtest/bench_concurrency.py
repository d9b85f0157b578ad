"""Concurrency benchmark: closed loop at 1, 4, 8, 16 concurrent streaming chat requests against
specd on the CPU default, with speculation modes measured in the same run, interleaved level by
level: ``adaptive`` (the server's default K controller), ``off`` (``speculation.enabled: false``)
and ``kN`` (a fixed ``speculation.k: N``).

The server runs in its own process (``specd serve`` on a free loopback port), so the load
generator never competes with it for the GIL. Prints output tok/s, mean and p95 inter-token
latency (per token: a chunk of n tokens after a gap g counts n times g/n), mean and p95 time to
first token, acceptance, and the server's peak RSS.

    python -m loadtest.bench_concurrency --levels 1,4,8,16 --requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import openai

from engine.config import EngineConfig
from engine.loader import prepare
from loadtest.datasets import mixed
from loadtest.server_proc import peak_rss_mib, specd_server


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def spec_option(mode: str) -> dict | None:
    if mode == "adaptive":
        return None
    if mode == "off":
        return {"enabled": False}
    if mode.startswith("k"):
        return {"k": int(mode[1:])}
    raise ValueError(f"unknown mode {mode!r} (adaptive, off, kN)")


async def one(client, model, tok, prompt, max_tokens, spec):
    t0 = time.perf_counter()
    extra = {"speculation": spec} if spec is not None else {}
    stream = await client.chat.completions.create(
        model=model,
        stream=True,
        max_tokens=max_tokens,
        temperature=0,
        messages=[{"role": "user", "content": prompt.text}],
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    first, last, itl, usage = None, None, [], None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices or not chunk.choices[0].delta.content:
            continue
        n = max(1, len(tok(chunk.choices[0].delta.content, add_special_tokens=False)["input_ids"]))
        if first is None:
            first = now
        else:
            itl += [(now - last) / n] * n
        last = now
    sp = usage.model_extra["speculation"]
    return {
        "ttft": (first or time.perf_counter()) - t0,
        "itl": itl,
        "tokens": usage.completion_tokens,
        "drafted": sp["drafted_tokens"],
        "accepted": sp["accepted_tokens"],
        "passes": sp["target_passes"],
    }


async def level(base_url, model, tok, prompts, concurrency, n_requests, max_tokens, mode):
    spec = spec_option(mode)
    todo = list(range(n_requests))
    results = []
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="x", max_retries=0, timeout=600
    ) as client:

        async def worker():
            while todo:
                i = todo.pop(0)
                results.append(
                    await one(client, model, tok, prompts[i % len(prompts)], max_tokens, spec)
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    drafted = sum(r["drafted"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "mode": mode,
        "requests": len(results),
        "tok_s": tokens / wall,
        "itl_mean_ms": 1000 * statistics.fmean(itl),
        "itl_p95_ms": 1000 * pct(itl, 95),
        "ttft_mean_ms": 1000 * statistics.fmean(ttft),
        "ttft_p95_ms": 1000 * pct(ttft, 95),
        "acceptance": sum(r["accepted"] for r in results) / drafted if drafted else 0.0,
        "tokens_per_pass": tokens / max(1, sum(r["passes"] for r in results)),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--modes", default="adaptive,off", help="adaptive, off, kN (fixed K=N)")
    ap.add_argument("--requests", type=int, default=16, help="requests per level, mode and repeat")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="repetitions per level; the mode order alternates (ABBA) between them",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default="loadtest/results/bench_concurrency.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    cfg = EngineConfig.from_yaml(args.config)
    tok = AutoTokenizer.from_pretrained(prepare(cfg.model.source, cfg.cache_dir, progress=False))
    levels = [int(x) for x in args.levels.split(",")]
    modes = args.modes.split(",")
    prompts = [p for p in mixed(2) if p.kind == "chat"]
    rows = []
    with specd_server(Path(args.config), max(levels)) as (base_url, pid):
        asyncio.run(level(base_url, cfg.model.name, tok, prompts, 2, 4, 16, modes[0]))  # warm-up
        for c in levels:
            for rep in range(args.repeat):
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    r = asyncio.run(
                        level(
                            base_url,
                            cfg.model.name,
                            tok,
                            prompts,
                            c,
                            max(args.requests, c),
                            args.max_tokens,
                            mode,
                        )
                    )
                    r["repeat"] = rep
                    rows.append(r)
                    print(
                        f"c={c:2d} {mode:>8} #{rep} {r['tok_s']:7.1f} tok/s  ITL mean "
                        f"{r['itl_mean_ms']:6.1f} p95 {r['itl_p95_ms']:6.1f} ms  TTFT mean "
                        f"{r['ttft_mean_ms']:7.1f} p95 {r['ttft_p95_ms']:7.1f} ms  acceptance "
                        f"{r['acceptance']:.2f}  tokens/pass {r['tokens_per_pass']:.2f}",
                        flush=True,
                    )
        rss = peak_rss_mib(pid)
    summary = summarize(rows, levels, modes)
    print(
        f"\nspecd concurrency benchmark ({cfg.model.dtype}, drafter {cfg.drafter.method}, "
        f"controller {cfg.drafter.controller}, max_tokens {args.max_tokens}, greedy, "
        f"{args.requests} requests per level, mode and repeat, {args.repeat} repeats, ABBA order); "
        f"server peak RSS {rss:.0f} MiB"
    )
    print(
        f"{'conc':>4} {'mode':>8} {'tok/s':>8} {'x c=' + str(levels[0]):>8} {'/ off':>6} "
        f"{'(min..max)':>11} {'ITL mean':>9} {'ITL p95':>8} {'TTFT mean':>10} {'TTFT p95':>9} "
        f"{'accept':>7} {'tok/pass':>8}"
    )
    for r in summary:
        spread = (
            f"{r['ratio_min']:.2f}..{r['ratio_max']:.2f}"
            if r["ratio_min"] == r["ratio_min"]
            else ""
        )
        print(
            f"{r['concurrency']:>4} {r['mode']:>8} {r['tok_s']:8.1f} {r['x_single']:8.2f} "
            f"{r['ratio_off']:6.2f} {spread:>11} {r['itl_mean_ms']:9.1f} {r['itl_p95_ms']:8.1f} "
            f"{r['ttft_mean_ms']:10.1f} {r['ttft_p95_ms']:9.1f} {r['acceptance']:7.2f} "
            f"{r['tokens_per_pass']:8.2f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {"args": vars(args), "peak_rss_mib": rss, "rows": rows, "summary": summary}, indent=1
        )
    )


def summarize(rows, levels, modes):
    """Mean over repeats per (level, mode); tok/s ratio to 'off' from the same repeat (so a
    repeat's machine state hits both), with its min..max over repeats."""
    nan = float("nan")
    out = []
    for c in levels:
        for mode in modes:
            rs = [r for r in rows if r["concurrency"] == c and r["mode"] == mode]
            avg = {
                k: statistics.fmean(r[k] for r in rs)
                for k in (
                    "tok_s",
                    "itl_mean_ms",
                    "itl_p95_ms",
                    "ttft_mean_ms",
                    "ttft_p95_ms",
                    "acceptance",
                    "tokens_per_pass",
                )
            }
            ratios = [
                r["tok_s"] / o["tok_s"]
                for r in rs
                for o in rows
                if o["mode"] == "off" and o["concurrency"] == c and o["repeat"] == r["repeat"]
            ]
            single = [
                r["tok_s"] for r in rows if r["concurrency"] == levels[0] and r["mode"] == mode
            ]
            out.append(
                {
                    "concurrency": c,
                    "mode": mode,
                    **avg,
                    "x_single": avg["tok_s"] / statistics.fmean(single),
                    "ratio_off": statistics.fmean(ratios) if ratios else nan,
                    "ratio_min": min(ratios) if ratios else nan,
                    "ratio_max": max(ratios) if ratios else nan,
                }
            )
    return out


if __name__ == "__main__":
    main()
