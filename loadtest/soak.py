"""Soak: N concurrent streaming clients with random disconnects against a live specd, for a bounded
duration; proves that a long, messy run loses nothing and leaks nothing.

    python -m loadtest.soak --duration 3600 --clients 16          # starts `specd serve` (fp32)
    python -m loadtest.soak --url http://127.0.0.1:8000 --pid 1234 --duration 600

1. reference: every prompt once, greedy, non-streamed, speculation off, one at a time; then a
   warm-up wave that puts the longest prompt in every KV slot;
2. soak: ``--clients`` streaming clients in a closed loop until ``--duration`` is over: random
   prompt (chat and completion endpoints), speculation adaptive / fixed K / off at random, and with
   probability ``--disconnect`` the client hangs up after a random number of events;
3. checks: zero unexpected errors (any non-200, error event, malformed or unfinished stream);
   every completed response equal to its reference, every abandoned one a prefix of it; KV cache
   back to zero and nothing running or waiting at the end (``/ready`` stats); the server's
   resident memory after warm-up (peak over the rest of the run vs peak during the first
   ``--warmup`` seconds) growing less than ``--rss-limit``.

Prints a summary; exit status 0 when every check passes. The server runs in fp32 (greedy outputs
are then exactly the target's whatever the batch); ``--url`` soaks a server you started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.modes import spec_option
from loadtest.server_proc import RssSampler, specd_server
from loadtest.soak_result import SoakResult
from prompts.sets import human_eval, mt_bench

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"
# the server's default (adaptive) twice as often as a fixed K and as no speculation
SPEC_MODES = [spec_option(m) for m in ("default", "default", "k4", "off")]


@dataclass
class Prompt:
    kind: str  # "chat" | "completion"
    text: str


def load_prompts(n: int) -> list[Prompt]:
    """The first MT-Bench question of each category and HumanEval prompts (offline packages)."""
    chat, seen = [], set()
    for p in mt_bench():
        if p.category not in seen:
            seen.add(p.category)
            chat.append(Prompt("chat", p.text))
    code = [Prompt("completion", p.text) for p in human_eval()]
    mixed = [p for pair in zip(chat, code) for p in pair] + code[len(chat) :]
    return mixed[:n]


@contextmanager
def specd_child(config: Path, clients: int, dtype: str = "float32"):
    """``specd serve`` in a child process (loadtest.server_proc); yields (root url, pid)."""
    with specd_server(config, clients, dtype) as server:
        yield server.url, server.pid


class Soak:
    def __init__(
        self,
        url: str,
        model: str,
        prompts: list[Prompt],
        max_tokens: int,
        disconnect: float,
        seed: int,
    ):
        self.url, self.model, self.prompts = url.rstrip("/"), model, prompts
        self.max_tokens, self.disconnect = max_tokens, disconnect
        self.rng = random.Random(seed)
        self.reference: list[str] = []
        self.result = SoakResult()

    def body(self, p: Prompt, stream: bool, spec: dict | None) -> tuple[str, dict]:
        b = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "stream": stream}
        if spec is not None:
            b["speculation"] = spec
        if p.kind == "chat":
            return "/v1/chat/completions", {**b, "messages": [{"role": "user", "content": p.text}]}
        return "/v1/completions", {**b, "prompt": p.text}

    async def make_reference(self, client: httpx.AsyncClient) -> None:
        for p in self.prompts:
            path, body = self.body(p, False, {"enabled": False})
            r = await client.post(path, json=body)
            r.raise_for_status()
            c = r.json()["choices"][0]
            self.reference.append(c["message"]["content"] if p.kind == "chat" else c["text"])

    async def one(self, client: httpx.AsyncClient) -> None:
        res, rng = self.result, self.rng
        i = rng.randrange(len(self.prompts))
        p, spec = self.prompts[i], rng.choice(SPEC_MODES)
        hang_up = rng.randint(1, self.max_tokens) if rng.random() < self.disconnect else None
        path, body = self.body(p, True, spec)
        res.requests += 1
        text, events, done, finished = [], 0, False, False
        try:
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    res.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        res.errors.append(f"error event: {obj['error'].get('message')}")
                        return
                    for c in obj.get("choices") or []:
                        piece = (
                            (c.get("delta") or {}).get("content")
                            if p.kind == "chat"
                            else c.get("text")
                        )
                        text.append(piece or "")
                        finished = finished or c.get("finish_reason") is not None
                    events += 1
                    res.tokens += 1
                    if hang_up is not None and events >= hang_up:
                        break  # leaving the block closes the connection mid-stream
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.errors.append(f"{type(e).__name__}: {e}")
            return
        out, ref = "".join(text), self.reference[i]
        if done:
            if not finished:
                res.errors.append("stream ended with [DONE] but no finish_reason")
            res.completed += 1
            if out != ref:
                res.mismatches.append(f"prompt {i} spec={spec}: {out[:80]!r} != {ref[:80]!r}")
        elif hang_up is not None:
            res.disconnected += 1
            if not ref.startswith(out):
                res.mismatches.append(
                    f"prompt {i} (abandoned) spec={spec}: {out[:80]!r} is not a "
                    f"prefix of {ref[:80]!r}"
                )
        else:
            res.errors.append("stream ended without [DONE]")

    async def fill_slots(self, client: httpx.AsyncClient, clients: int) -> None:
        """Warm-up wave: the longest prompt in every KV slot at once, so that the cache pages the
        run will touch are resident before the RSS baseline (the cache is allocated zeroed and
        becomes resident as positions are first written: that is no leak)."""
        longest = max(self.prompts, key=lambda p: len(p.text))
        for spec in (None, {"enabled": False}):
            path, body = self.body(longest, False, spec)
            await asyncio.gather(*(client.post(path, json=body) for _ in range(clients)))

    async def client_loop(self, client: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            await self.one(client)

    async def end_stats(self, client: httpx.AsyncClient, timeout: float = 60) -> dict:
        """``/ready`` stats once nothing runs (aborts land between engine steps)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = (await client.get("/ready")).json()
            quiet = (
                not stats.get("running")
                and not stats.get("waiting")
                and not stats.get("kv_used_tokens")
            )
            if quiet or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.2)

    async def run(
        self, clients: int, duration: float, warmup: float, pid: int | None
    ) -> SoakResult:
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:
            await self.make_reference(client)
            await self.fill_slots(client, clients)
            rss = RssSampler(pid) if pid is not None else None
            if rss is not None:
                rss.start()
            t0 = time.monotonic()
            until = t0 + duration
            await asyncio.gather(*(self.client_loop(client, until) for _ in range(clients)))
            self.result.duration_s = time.monotonic() - t0
            self.result.end_stats = await self.end_stats(client)
            if rss is not None:
                rss.stop()
                self.result.rss_warm_mib = rss.peak_between(t0, t0 + warmup)
                self.result.rss_peak_mib = rss.peak_between(t0 + warmup)
        return self.result


def soak(
    url: str,
    *,
    clients: int = 16,
    duration: float = 120,
    warmup: float | None = None,
    max_tokens: int = 48,
    disconnect: float = 0.2,
    prompts: int = 8,
    seed: int = 0,
    pid: int | None = None,
    rss_limit: float = 0.05,
) -> SoakResult:
    """Run the soak against ``url`` (the server's root, e.g. http://127.0.0.1:8000)."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    s = Soak(url, model, load_prompts(prompts), max_tokens, disconnect, seed)
    s.result.rss_limit = rss_limit
    if warmup is None:
        warmup = min(300.0, 0.2 * duration)
    return asyncio.run(s.run(clients, duration, warmup, pid))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--url", help="soak this running server (root URL); default: start specd serve")
    ap.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--dtype", default="float32", help="for the started server (default float32)")
    ap.add_argument("--duration", type=float, default=120, help="seconds of soak (default 120)")
    ap.add_argument(
        "--warmup", type=float, help="seconds counted as warm-up (default 20%%, <= 300)"
    )
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--disconnect", type=float, default=0.2, help="share of clients that hang up")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-limit", type=float, default=0.05)
    a = ap.parse_args(argv)
    kw = dict(
        clients=a.clients,
        duration=a.duration,
        warmup=a.warmup,
        max_tokens=a.max_tokens,
        disconnect=a.disconnect,
        prompts=a.prompts,
        seed=a.seed,
        rss_limit=a.rss_limit,
    )
    if a.url:
        result = soak(a.url, pid=a.pid, **kw)
    else:
        with specd_child(a.config, a.clients, a.dtype) as (url, pid):
            result = soak(url, pid=pid, **kw)
    print(result.summary(), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
