"""Load shapes. Both are bounded in requests and in time, and stop by themselves.

* closed loop: ``concurrency`` clients, each sends its next request when the previous one ends.
* open loop: requests arrive as a Poisson process at ``rate`` per second (seeded exponential gaps),
  whatever the server's progress.

Request i sends ``items[i % len(items)]``, so two runs with the same arguments send the same
prompts in the same order. At ``duration`` seconds no new request starts; requests still running
at ``duration + grace`` are cancelled and recorded with an error "cancelled: run time limit".
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

Send = Callable[[object, list], Awaitable[None]]  # (item, records sink) -> None


async def _bounded(tasks: list[asyncio.Task], t0: float, duration: float, grace: float) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(
        tasks, timeout=max(0.0, t0 + duration + grace - time.perf_counter())
    )
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def closed_loop(
    items: list,
    send: Send,
    concurrency: int,
    requests: int,
    duration: float,
    grace: float = 60.0,
    on_done: Callable[[], None] = lambda: None,
):
    """Returns (records, wall seconds)."""
    records: list = []
    next_i = 0
    t0 = time.perf_counter()

    async def client():
        nonlocal next_i
        while next_i < requests and time.perf_counter() - t0 < duration:
            i, next_i = next_i, next_i + 1
            await send(items[i % len(items)], records)
            on_done()

    await _bounded([asyncio.create_task(client()) for _ in range(concurrency)], t0, duration, grace)
    return records, time.perf_counter() - t0


async def open_loop(
    items: list,
    send: Send,
    rate: float,
    requests: int,
    duration: float,
    seed: int = 0,
    grace: float = 60.0,
    on_done: Callable[[], None] = lambda: None,
):
    """Returns (records, wall seconds)."""
    rng = random.Random(seed)
    records: list = []
    tasks: list[asyncio.Task] = []
    t0 = time.perf_counter()

    async def one(item):
        await send(item, records)
        on_done()

    at = 0.0
    for i in range(requests):
        if i:
            at += rng.expovariate(rate)
        if at >= duration:
            break
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(items[i % len(items)])))
    await _bounded(tasks, t0, duration, grace)
    return records, time.perf_counter() - t0
