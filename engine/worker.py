"""The async engine worker: owns the engine, runs its steps in a dedicated thread, and streams
each request's outputs to the asyncio side through that request's own queue.

    worker = EngineWorker(engine); worker.start()
    async for out in worker.submit(request_id, prompt_ids, params, spec): ...
    worker.abort(request_id)      # e.g. on client disconnect; frees the request's KV slot

The engine is touched only by the worker thread: submissions and aborts travel through a
thread-safe inbox that the thread drains between steps. Outputs go back through each request's
:class:`_Channel`, which is bounded: at most ``max_buffered`` outputs wait for a reader; past that
the engine thread merges each new output into the last waiting one (tokens, logprobs, counts
concatenated). So a client that stops reading never blocks the engine and never holds more than
its own request's tokens: the request runs to its end, frees its KV slot, and its text waits
(lossless) until the reader comes back or disconnects.

An exception inside a step fails the requests that were in that step (running, prefilling, and
any the failed admission had taken) with an error output and frees their cache; requests still
waiting for a slot stay queued, and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

from .engine import SpecEngine, StepOutput
from .sampling import SamplingParams
from .sequence import SpecParams

log = logging.getLogger("specd.worker")


class EngineError(RuntimeError):
    """The engine failed while running a request (the request is over)."""


class QueueFullError(RuntimeError):
    """More requests in flight than running slots + queue allow (the server answers 429)."""


class NotAcceptingError(RuntimeError):
    """The worker is not running or is shutting down (the server answers 503)."""


def merge_outputs(a: StepOutput, b: StepOutput) -> StepOutput:
    """One output standing for ``a`` then ``b`` (of the same request)."""
    stats = b.stats
    if a.stats is not None and b.stats is not None:
        stats = replace(
            b.stats,
            drafted=a.stats.drafted + b.stats.drafted,
            accepted=a.stats.accepted + b.stats.accepted,
            emitted=a.stats.emitted + b.stats.emitted,
        )
    elif a.stats is not None:
        stats = a.stats
    cat = lambda x, y: None if x is None and y is None else (x or []) + (y or [])
    return replace(
        b,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        stats=stats,
        logprobs=cat(a.logprobs, b.logprobs),
        top_logprobs=cat(a.top_logprobs, b.top_logprobs),
        passes=a.passes + b.passes,
    )


class _Channel:
    """One request's outputs, from the engine thread (:meth:`put`) to its asyncio reader
    (:meth:`get`). At most ``max_items`` wait; a further output merges into the last one."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_items: int):
        self.loop, self.max_items = loop, max(1, max_items)
        self.items: deque = deque()
        self.lock = threading.Lock()
        self.ready = asyncio.Event()
        self.merged = 0  # outputs merged because the reader lagged

    def put(self, item) -> None:  # engine thread
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
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # the reader's loop is closed: nobody is listening
            pass

    async def get(self):  # the reader's loop
        while True:
            with self.lock:
                if self.items:
                    return self.items.popleft()
                self.ready.clear()
            await self.ready.wait()


class EngineWorker:
    def __init__(self, engine: SpecEngine, max_queued: int | None = None, max_buffered: int = 64):
        from .rejection import rejection_sample

        if getattr(engine, "accept", rejection_sample) is not rejection_sample:
            raise ValueError(
                "this engine's acceptance rule is not the exact rejection rule "
                "(a benchmark's synthetic acceptance): refusing to serve it"
            )
        self.engine = engine
        # requests in flight beyond the running slots; None: unbounded
        self.max_queued = max_queued
        self.max_buffered = max_buffered  # outputs waiting per request before they are merged
        self._accepting = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._channels: dict[str, _Channel] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._drain_deadline: float | None = None  # set by request_shutdown()
        self._thread: threading.Thread | None = None
        self.healthy = True
        # set once the engine's compiled forwards are warmed up (at once when it has none)
        self.warmed = threading.Event()
        # called in the engine thread after every step with (outputs, self.stats()): metrics
        self.observers: list = []

    # -- lifecycle ------------------------------------------------------------------------------
    def _mark_warm_if_nothing_to_compile(self) -> None:
        if not getattr(self.engine, "needs_warm_up", lambda: False)():
            self.warmed.set()

    def start(self) -> None:
        self._mark_warm_if_nothing_to_compile()
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self._thread.start()

    def run_here(self) -> None:
        """Run the engine loop in the calling thread until :meth:`request_shutdown` (the server
        calls it from the main thread: on CPU, torch's OpenMP thread team stays hot only for the
        process's main thread; every forward ran 2x slower on 2 cores from a second thread)."""
        self._mark_warm_if_nothing_to_compile()
        self._thread = threading.current_thread()
        self._run()

    def request_shutdown(self, timeout: float = 10.0) -> None:
        """Graceful stop of a :meth:`run_here` loop, safe in a signal handler: stop admitting, let
        running requests finish for up to ``timeout`` seconds, then fail what is left."""
        self._accepting = False
        self._drain_deadline = time.monotonic() + timeout
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Graceful: stop admitting, let running requests finish for up to ``timeout`` seconds,
        then fail what is left with an error and stop the thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.running and self._channels and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(1.0, deadline - time.monotonic()))

    # -- the asyncio side -----------------------------------------------------------------------
    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecParams | None = None,
    ) -> AsyncIterator[StepOutput]:
        self.check_admission(1)
        if request_id in self._channels:
            raise ValueError(f"duplicate request id {request_id!r}")
        ch = _Channel(asyncio.get_running_loop(), self.max_buffered)
        self._channels[request_id] = ch
        self._inbox.put(("add", request_id, prompt_ids, params, spec))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await ch.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._channels.pop(request_id, None)
            if not finished:  # consumer went away (disconnect, cancel): stop the work
                self.abort(request_id)

    def check_admission(self, count: int) -> None:
        """Raise unless ``count`` more requests can be taken now (call before answering 200)."""
        if not (self._accepting and self.running):
            raise NotAcceptingError("the engine is not accepting requests")
        if not self.warmed.is_set():
            raise NotAcceptingError("the engine is warming up (compiling); retry shortly")
        if (
            self.max_queued is not None
            and len(self._channels) + count > self.engine.target.cache.num_slots + self.max_queued
        ):
            raise QueueFullError("the server is at capacity (request queue full); retry later")

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        e = self.engine
        return {
            "running": len(e.running) + len(e.prefilling),
            "waiting": len(e.waiting),
            "kv_used_tokens": e.target.cache.used_tokens(),
            "kv_free_slots": e.target.cache.num_free(),
            "kv_slots": e.target.cache.num_slots,
            "drafter_failures": getattr(e, "drafter_failures", 0),
        }

    # -- the worker thread -------------------------------------------------------------------
    def _send(self, request_id: str, item) -> None:
        ch = self._channels.get(request_id)
        if ch is not None:
            ch.put(item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, spec = cmd
                try:
                    self.engine.add_request(rid, prompt, params, spec)
                except Exception as e:  # invalid request: fail it alone (the server validated
                    # it first, so this is internal: the text goes to the log, not the client)
                    log.error("engine refused request %s: %s: %s", rid, type(e).__name__, e)
                    self._send(rid, EngineError("the engine could not start this request"))
            else:
                self.engine.abort(cmd[1])

    def _run(self) -> None:
        if not self.warmed.is_set():
            try:
                self.engine.warm_up()  # compile failures fall back to eager inside
            except Exception:
                log.exception("warm-up failed")
            self.warmed.set()
        while not self._stop.is_set():
            if self._drain_deadline is not None and (
                not self._channels or time.monotonic() > self._drain_deadline
            ):
                break
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            e = self.engine
            in_step = [s.request_id for s in (*e.running, *e.prefilling, *e.waiting)]
            try:
                outputs = e.step()
            except Exception:  # a model step failed: fail what was in it, keep serving
                log.exception("engine step failed")
                self._fail_step(in_step)
                continue
            for out in outputs:
                self._send(out.request_id, out)
            stats = self.stats() if self.observers else None
            for observe in self.observers:
                try:
                    observe(outputs, stats)
                except Exception:  # an observer must never stop the engine
                    log.exception("step observer failed")
        self._fail_all(EngineError("the server is shutting down"))

    def _fail_step(self, known: list[str]) -> None:
        """After a failed step: fail every request the step held or took from the queue (its
        outputs of that step are lost); requests still waiting for a slot stay queued."""
        e = self.engine
        still_waiting = {s.request_id for s in e.waiting}
        err = EngineError("the engine failed while generating this response")
        for rid in known:
            if rid not in still_waiting:
                e.abort(rid)
                self._send(rid, err)

    def _fail_all(self, err: EngineError) -> None:
        e = self.engine
        for seq in list(e.running) + list(e.prefilling) + list(e.waiting):
            e.abort(seq.request_id)
            self._send(seq.request_id, err)
