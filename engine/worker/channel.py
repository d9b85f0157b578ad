"""One request's outputs on their way from the engine thread to the request's asyncio reader.

A :class:`Channel` holds at most ``max_items`` outputs; past that each new output merges into the
last one waiting (:func:`merge_outputs`: tokens, logprobs and counts concatenated, nothing
dropped), so a reader that stops costs the engine nothing and holds no more than its own
request's tokens. An exception put in the channel ends the reader's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections import deque

from engine.records.output import StepOutput


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """One output standing for ``a`` then ``b`` (of the same request)."""
    stats = b.stats
    if a.stats is not None and b.stats is not None:
        stats = dataclasses.replace(
            b.stats,
            drafted=a.stats.drafted + b.stats.drafted,
            accepted=a.stats.accepted + b.stats.accepted,
            emitted=a.stats.emitted + b.stats.emitted,
            forced=a.stats.forced + b.stats.forced,
        )
    elif a.stats is not None:
        stats = a.stats

    def cat(x, y):  # None stays None: the request asked for no logprobs
        return None if x is None and y is None else (x or []) + (y or [])

    return dataclasses.replace(
        b,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        stats=stats,
        logprobs=cat(a.logprobs, b.logprobs),
        top_logprobs=cat(a.top_logprobs, b.top_logprobs),
        passes=a.passes + b.passes,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


class Channel:
    """One request's outputs, from the engine thread (:meth:`put`) to its asyncio reader
    (:meth:`get`). At most ``max_items`` wait; a further output merges into the last one."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_items: int):
        self.loop, self.max_items = loop, max(1, max_items)
        self.items: deque = deque()
        self.lock = threading.Lock()
        self.ready = asyncio.Event()
        self.merged = 0  # outputs merged because the reader lagged

    def put(self, item: StepOutput | Exception) -> None:  # engine thread
        with self.lock:
            last = self.items[-1] if self.items else None
            if (
                len(self.items) >= self.max_items
                and isinstance(item, StepOutput)
                and isinstance(last, StepOutput)
                and not last.finished
            ):
                self.items[-1] = merge_outputs(last, item)
                self.merged += 1
            else:
                self.items.append(item)
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            self.loop.call_soon_threadsafe(self.ready.set)

    async def get(self) -> StepOutput | Exception:  # the reader's loop
        while True:
            with self.lock:
                if self.items:
                    return self.items.popleft()
                self.ready.clear()
            await self.ready.wait()
