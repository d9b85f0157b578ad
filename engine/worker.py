"""The async engine worker: owns the engine, runs its steps in a dedicated thread, and streams
each request's outputs to the asyncio side through that request's own queue.

    worker = EngineWorker(engine); worker.start()
    async for out in worker.submit(request_id, prompt_ids, params, spec): ...
    worker.abort(request_id)      # e.g. on client disconnect; frees the request's KV slot

The engine is touched only by the worker thread: submissions and aborts travel through a
thread-safe inbox that the thread drains between steps. Outputs go back with
``loop.call_soon_threadsafe``. An exception inside a step fails the requests that were in the
engine with an error output, frees their cache, and the worker keeps serving new requests.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator

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


@dataclass
class _Channel:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineWorker:
    def __init__(self, engine: SpecEngine, max_queued: int | None = None):
        self.engine = engine
        # requests in flight beyond the running slots; None: unbounded
        self.max_queued = max_queued
        self._accepting = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._channels: dict[str, _Channel] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.healthy = True
        # called in the engine thread after every step with (outputs, self.stats()): metrics
        self.observers: list = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Graceful: stop admitting, let running requests finish for up to ``timeout`` seconds,
        then fail what is left with an error and stop the thread."""
        import time
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.running and self._channels and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(1.0, deadline - time.monotonic()))

    # -- the asyncio side -----------------------------------------------------------------------
    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     spec: SpecParams | None = None) -> AsyncIterator[StepOutput]:
        self.check_admission(1)
        if request_id in self._channels:
            raise ValueError(f"duplicate request id {request_id!r}")
        ch = _Channel(asyncio.get_running_loop(), asyncio.Queue())
        self._channels[request_id] = ch
        self._inbox.put(("add", request_id, prompt_ids, params, spec))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await ch.queue.get()
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
        if self.max_queued is not None and \
                len(self._channels) + count > self.engine.target.cache.num_slots + self.max_queued:
            raise QueueFullError("the server is at capacity (request queue full); retry later")

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        e = self.engine
        return {"running": len(e.running) + len(e.prefilling), "waiting": len(e.waiting),
                "kv_used_tokens": e.target.cache.used_tokens(),
                "kv_free_slots": e.target.cache.num_free(), "kv_slots": e.target.cache.num_slots}

    # -- the worker thread -------------------------------------------------------------------
    def _send(self, request_id: str, item) -> None:
        ch = self._channels.get(request_id)
        if ch is not None:
            ch.loop.call_soon_threadsafe(ch.queue.put_nowait, item)

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
                except Exception as e:  # invalid request: fail it alone
                    self._send(rid, EngineError(str(e)))
            else:
                self.engine.abort(cmd[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a model step failed: fail what was in it, keep serving
                log.exception("engine step failed")
                self._fail_all(EngineError("the engine failed while generating this response"))
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

    def _fail_all(self, err: EngineError) -> None:
        e = self.engine
        for seq in list(e.running) + list(e.prefilling) + list(e.waiting):
            e.abort(seq.request_id)
            self._send(seq.request_id, err)
