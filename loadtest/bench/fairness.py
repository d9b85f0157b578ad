"""Fairness over HTTP: how long a one-line request takes while one big request holds the engine.

The big request is the case of many choices: 8 prompts of ~300 tokens x ``n = 8`` choices (64
sequences), ``--big-tokens`` tokens each, on a server with 16 slots. Once it has run
``--head-start`` seconds, one-line requests (greedy, 16 tokens) are sent one after another until
it ends; their median latency is printed next to the same request's on the idle server. Two
servers of the config, one after the other: as given with ``bulk_slots`` (a request of many
sequences keeps that many slots while a smaller one is in the engine:
engine/requests/scheduler.py) and without that cap (only ``max_slots_per_request``).

    python -m loadtest.bench.fairness --config configs/default.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from loadtest.server_proc import specd_server

SMALL = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
FILLER = (
    "The story should have a clear beginning, a middle with a problem to solve, and an ending "
    "that ties the threads together; give every character a name and a reason to act. "
)


def timed(client: httpx.Client, body: dict) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0


def measure(config: Path, big_tokens: int, head_start: float) -> dict:
    """One server: the one-line request alone (median of 5), then beside the big request."""
    with specd_server(config, max_running=16) as server:
        client = httpx.Client(base_url=server.url)
        model = client.get("/v1/models").json()["data"][0]["id"]
        small = SMALL | {"model": model}
        timed(client, small)  # warm
        alone = statistics.median(timed(client, small) for _ in range(5))
        big = {
            "model": model,
            "prompt": [
                f"Write a long story about a {w}. " + FILLER * 9
                for w in ["cat", "dog", "fox", "owl", "bee", "ant", "elk", "yak"]
            ],
            "n": 8,
            "max_tokens": big_tokens,
            "temperature": 0.8,
            "seed": 1,
        }
        big_time: list[float] = []
        t = threading.Thread(
            target=lambda: big_time.append(timed(httpx.Client(base_url=server.url), big))
        )
        t.start()
        time.sleep(head_start)
        beside = []
        while t.is_alive():
            beside.append(timed(client, small))
        t.join()
        ready = client.get("/ready").json()
    return {
        "one_line_alone_s": round(alone, 3),
        "one_line_beside_64_choices_s": round(statistics.median(beside), 3),
        "one_line_requests_beside": len(beside),
        "ratio": round(statistics.median(beside) / alone, 2),
        "big_request_s": round(big_time[0], 1) if big_time else None,
        "preemptions": ready.get("preemptions"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench.fairness")
    ap.add_argument("--config", default="configs/default.yaml")
    ap.add_argument("--head-start", type=float, default=3.0)
    ap.add_argument("--big-tokens", type=int, default=32)
    ap.add_argument("--out", default="loadtest/results/fairness.txt")
    args = ap.parse_args(argv)
    data = yaml.safe_load(Path(args.config).read_text())
    bulk = data["engine"].get("bulk_slots")
    result = {"config": args.config}
    with tempfile.TemporaryDirectory() as tmp:
        for name, value in ((f"bulk_slots {bulk}", bulk), ("no bulk cap", None)):
            data["engine"]["bulk_slots"] = value
            path = Path(tmp) / "config.yaml"
            path.write_text(yaml.safe_dump(data))
            result[name] = measure(path, args.big_tokens, args.head_start)
    text = json.dumps(result, indent=2)
    print(text)
    cmd = f"python -m loadtest.bench.fairness --config {args.config} --big-tokens {args.big_tokens}"
    Path(args.out).write_text(f"# {cmd}\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
