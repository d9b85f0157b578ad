"""Wall-clock timing of device work: the one helper every forward timing goes through.

Invariant: a timed call starts after the device finished all earlier work and ends after the
device finished the call's own work (``synchronize`` on CUDA; a no-op on CPU, where torch runs
eagerly), so the time covers the kernels and nothing queued before them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait for every kernel queued on ``device`` (no-op on CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_call(
    fn: Callable[[], object], device: torch.device | str | None, repeats: int = 1, warmup: int = 0
) -> float:
    """Best-of-``repeats`` seconds of ``fn()`` on ``device`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(max(1, repeats)):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def time_calls(
    fn: Callable[[], object], device: torch.device | str | None, repeats: int, warmup: int = 0
) -> list[float]:
    """Every one of ``repeats`` timed calls of ``fn()`` (seconds), after ``warmup`` untimed."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


class PhaseClock:
    """The times between marks of one round, without a sync of its own. On CPU, where torch runs
    eagerly, a mark is the wall clock. On CUDA the host only queues a phase's kernels: the wall
    clock would price a draft model's phase at its launches and bill its run to whatever syncs
    next. There a mark is also a CUDA event on the stream, read after the round's one sync (the
    events before it are complete by then), and a phase costs the longer of its host time (an
    n-gram lookup, say) and its device time (a draft model's steps): the two overlap."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.walls: list[float] = []
        self.events: list = []

    def mark(self) -> None:
        self.walls.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def seconds(self, i: int, j: int) -> float:
        """Seconds from mark ``i`` to mark ``j`` (on CUDA: only after a sync covering both)."""
        wall = self.walls[j] - self.walls[i]
        if not self.cuda:
            return wall
        return max(wall, self.events[i].elapsed_time(self.events[j]) / 1e3)
