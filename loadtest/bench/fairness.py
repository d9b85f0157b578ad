"""Fairness over HTTP: how long a one-line request takes while one big request holds the engine.

The big request is issue 17's case: 8 prompts x ``n = 8`` choices (64 sequences), 300 tokens each,
on a server with 16 slots. Once it has been running ``--head-start`` seconds a one-line request
(greedy, 16 tokens) is sent; its latency is printed next to the same request on the idle server
(the scheduler caps what one request holds: engine/requests/scheduler.py,
``max_slots_per_request``).

    python -m loadtest.bench.fairness --config configs/default.yaml
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

from loadtest.server_proc import specd_server

SMALL = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}


def timed(client: httpx.Client, body: dict) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.fairness")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--head-start", type=float, default=5.0)
    ap.add_argument("--big-tokens", type=int, default=300)
    ap.add_argument("--out", default="loadtest/results/fairness.txt")
    args = ap.parse_args(argv)
    with specd_server(Path(args.config), max_running=16) as server:
        client = httpx.Client(base_url=server.url)
        model = client.get("/v1/models").json()["data"][0]["id"]
        small = SMALL | {"model": model}
        timed(client, small)  # warm
        alone = min(timed(client, small) for _ in range(3))
        big = {
            "model": model,
            "prompt": [
                f"Write a long story about a {w}."
                for w in ["cat", "dog", "fox", "owl", "bee", "ant", "elk", "yak"]
            ],
            "n": 8,
            "max_tokens": args.big_tokens,
            "temperature": 0.8,
            "seed": 1,
        }
        big_time: list[float] = []
        t = threading.Thread(
            target=lambda: big_time.append(timed(httpx.Client(base_url=server.url), big))
        )
        t.start()
        time.sleep(args.head_start)
        under_load = timed(client, small)
        t.join()
    result = {
        "config": args.config,
        "one_line_alone_s": round(alone, 3),
        "one_line_beside_64_choices_s": round(under_load, 3),
        "ratio": round(under_load / alone, 2),
        "big_request_s": round(big_time[0], 1) if big_time else None,
    }
    text = json.dumps(result, indent=2)
    print(text)
    cmd = f"python -m loadtest.bench.fairness --config {args.config} --big-tokens {args.big_tokens}"
    Path(args.out).write_text(f"# {cmd}\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
