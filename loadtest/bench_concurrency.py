"""Concurrency benchmark: closed loop at 1, 4, 8, 16 concurrent streaming chat requests against
specd on the CPU default, speculation on and off (per-request ``speculation`` option) measured in
the same run, interleaved level by level. Prints output tok/s, mean and p95 inter-token latency
(per token: a chunk of n tokens after a gap g counts n times g/n), mean and p95 time to first token.

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
from loadtest.datasets import mixed
from loadtest.serve_inproc import serve


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one(client, model, tok, prompt, max_tokens, spec_on):
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": prompt.text}],
        stream_options={"include_usage": True},
        extra_body={"speculation": {"enabled": spec_on}})
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
    return {"ttft": (first or time.perf_counter()) - t0, "itl": itl, "tokens": usage.completion_tokens,
            "drafted": usage.model_extra["speculation"]["drafted_tokens"],
            "accepted": usage.model_extra["speculation"]["accepted_tokens"]}


async def level(base_url, model, tok, prompts, concurrency, n_requests, max_tokens, spec_on):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600)
    todo = list(range(n_requests))
    results = []

    async def worker():
        while todo:
            i = todo.pop(0)
            results.append(await one(client, model, tok, prompts[i % len(prompts)], max_tokens, spec_on))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    drafted = sum(r["drafted"] for r in results)
    return {"concurrency": concurrency, "speculation": spec_on, "requests": len(results),
            "tok_s": sum(r["tokens"] for r in results) / wall, "itl_mean_ms": 1000 * statistics.fmean(itl),
            "itl_p95_ms": 1000 * pct(itl, 95), "ttft_mean_ms": 1000 * statistics.fmean(ttft),
            "ttft_p95_ms": 1000 * pct(ttft, 95),
            "acceptance": sum(r["accepted"] for r in results) / drafted if drafted else 0.0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per level and mode")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default="loadtest/results/bench_concurrency.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = EngineConfig.from_yaml(args.config)
    cfg.max_running = max(cfg.max_running, max(int(x) for x in args.levels.split(",")))
    prompts = [p for p in mixed(2) if p.kind == "chat"]
    rows = []
    with serve(cfg) as (base_url, built):
        tok = built.tokenizer
        asyncio.run(level(base_url, cfg.model.name, tok, prompts, 2, 2, 16, True))  # warm-up
        for c in [int(x) for x in args.levels.split(",")]:
            for spec_on in (True, False):
                r = asyncio.run(level(base_url, cfg.model.name, tok, prompts, c,
                                      max(args.requests, c), args.max_tokens, spec_on))
                rows.append(r)
                print(f"c={c:2d} spec={'on ' if spec_on else 'off'} {r['tok_s']:7.1f} tok/s  "
                      f"ITL mean {r['itl_mean_ms']:6.1f} p95 {r['itl_p95_ms']:6.1f} ms  "
                      f"TTFT mean {r['ttft_mean_ms']:7.1f} p95 {r['ttft_p95_ms']:7.1f} ms  "
                      f"acceptance {r['acceptance']:.2f}", flush=True)
    base = {r["speculation"]: r["tok_s"] for r in rows if r["concurrency"] == rows[0]["concurrency"]}
    print(f"\nspecd concurrency benchmark ({cfg.model.dtype}, drafter {cfg.drafter.method} "
          f"K={cfg.drafter.k}, max_tokens {args.max_tokens}, greedy)")
    print(f"{'conc':>4} {'spec':>4} {'tok/s':>8} {'x single':>8} {'on/off':>7} {'ITL mean':>9} "
          f"{'ITL p95':>8} {'TTFT mean':>10} {'TTFT p95':>9}")
    for r in rows:
        other = next(x for x in rows if x["concurrency"] == r["concurrency"] and x["speculation"] != r["speculation"])
        ratio = r["tok_s"] / other["tok_s"] if r["speculation"] else float("nan")
        print(f"{r['concurrency']:>4} {'on' if r['speculation'] else 'off':>4} {r['tok_s']:8.1f} "
              f"{r['tok_s'] / base[r['speculation']]:8.2f} {ratio:7.2f} {r['itl_mean_ms']:9.1f} "
              f"{r['itl_p95_ms']:8.1f} {r['ttft_mean_ms']:10.1f} {r['ttft_p95_ms']:9.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
