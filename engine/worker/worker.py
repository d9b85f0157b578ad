"""The async engine worker: owns an engine (the :class:`Engine` protocol), runs its steps in one
thread, and streams each request's outputs to the asyncio side through that request's channel.

    worker = EngineWorker(engine); worker.start()   # or worker.run_here() from the main thread
    with worker.reserve(n) as room:                 # admission: QueueFullError / NotAcceptingError
        async for out in worker.submit(request_id, prompt_ids, params, spec, room): ...

Invariants. Only the engine thread touches the engine (submissions and aborts travel through an
inbox it drains between steps). :meth:`EngineWorker.reserve` is the one admission check: under one
lock, the reserved total stays within ``num_slots + max_queued``. Outputs travel through each
request's bounded :class:`~engine.worker.channel.Channel`: a reader that stops never blocks the
engine. A failed step fails the requests in it (holding a slot, or taken from the queue by it);
queued ones stay queued. An exception that escapes the loop stops the worker: ``healthy`` turns
false, every open request gets an :class:`EngineError`, nothing is admitted again. A drain
(:meth:`EngineWorker.shutdown`) ends the loop only when every admitted request is over or the
deadline has passed; then each one left gets a :class:`DrainTimeoutError`, never silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable

from engine.protocol import Engine
from engine.records.output import StepOutput
from engine.records.params import SamplingParams, SpecParams
from engine.requests.admission import (
    DrainTimeoutError,
    EngineError,
    NotAcceptingError,
    QueueFullError,
    Reservation,
)
from engine.worker.channel import Channel


@dataclasses.dataclass(frozen=True)
class Add:
    """An HTTP thread's request for the engine thread: start this request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams | None
    group: str | None


@dataclasses.dataclass(frozen=True)
class Abort:
    """An HTTP thread's request for the engine thread: stop this request."""

    request_id: str


log = logging.getLogger("specd.worker")
CUT = "the server shut down before this response finished"  # a drain's deadline passed


class EngineWorker:
    def __init__(self, engine: Engine, max_queued: int | None = None, max_buffered: int = 64):
        if not engine.lossless:
            raise ValueError(
                "this engine's acceptance rule is not the exact rejection rule "
                "(a benchmark's synthetic acceptance): refusing to serve it"
            )
        self.engine = engine
        self.max_queued = max_queued  # requests in flight beyond the slots; None: unbounded
        self.max_buffered = max_buffered  # outputs waiting per request before they are merged
        self._lock = threading.Lock()  # admission, channel registration, closing
        self._reserved = 0  # room held by live reservations
        self._accepting, self._closed = True, False  # closed: the engine loop has ended
        self.running = False  # the engine loop runs (or is about to)
        self._inbox: queue.SimpleQueue[Add | Abort] = queue.SimpleQueue()
        self._channels: dict[str, Channel] = {}
        self._wake = threading.Event()
        self._drain_deadline: float | None = None  # set by shutdown()
        self._thread: threading.Thread | None = None
        self.healthy = True  # false once an exception escaped the engine loop
        # time.monotonic() when the loop last came round (a step ended, or it woke idle)
        self.beat = time.monotonic()
        self.warmed = threading.Event()  # compiled forwards warmed up (at once when none)
        # called in the engine thread after every step with (outputs, self.stats()): metrics
        self.observers: list[Callable[[list[StepOutput], dict], None]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine loop in a thread of its own."""
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self._begin()
        self._thread.start()

    def run_here(self) -> None:
        """Run the engine loop in the calling thread until :meth:`shutdown` (the server runs it
        in the main thread: on CPU, torch's OpenMP thread team stays hot only for the process's
        main thread). Re-raises what killed the loop, if anything did."""
        self._begin()
        if (fatal := self._run()) is not None:
            raise fatal

    def _begin(self) -> None:
        self.running = True
        if not self.engine.needs_warm_up():
            self.warmed.set()

    def shutdown(self, timeout: float = 10.0, wait: bool = True) -> None:
        """Drain: stop admitting (``accepting`` turns false at once), let every request the
        worker holds finish for up to ``timeout`` seconds — admitted ones whose submission has
        not arrived yet, queued and running ones — then answer what is left with a
        :class:`DrainTimeoutError` and end the loop. ``wait``: until a :meth:`start` thread has
        ended (without it, safe in a signal handler). A second call can only shorten the
        deadline."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline
            expire = threading.Timer(timeout, self._answer_all, (DrainTimeoutError(CUT),))
            expire.daemon = True  # on time even while a step outlasts the deadline (busy CPU)
            expire.start()
        self._wake.set()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout + 10)

    @property
    def accepting(self) -> bool:
        """Admitting new requests: running, healthy, warmed up and not draining (``/ready``)."""
        ok = self.running and self.healthy and not self._closed
        return ok and self._accepting and self.warmed.is_set()

    @property
    def draining(self) -> bool:
        """:meth:`shutdown` was called: nothing new is admitted, what is held finishes."""
        return not self._accepting

    @property
    def in_flight(self) -> int:  # room held by live reservations: admitted, not over yet
        return self._reserved

    # -- the asyncio side -----------------------------------------------------------------------
    def reserve(self, count: int) -> Reservation:
        """Admit ``count`` requests (the one admission check; call it before answering 200)."""
        with self._lock:
            if not self._accepting:
                raise NotAcceptingError("the server is shutting down; retry on another replica")
            if not (self.running and self.healthy) or self._closed:
                raise NotAcceptingError("the engine is not accepting requests")
            if not self.warmed.is_set():
                raise NotAcceptingError("the engine is warming up (compiling); retry shortly")
            cap = None if self.max_queued is None else self.engine.num_slots + self.max_queued
            if cap is not None and self._reserved + count > cap:
                raise QueueFullError("the server is at capacity (request queue full); retry later")
            self._reserved += count
        return Reservation(count, self._give_back)

    def _give_back(self, count: int) -> None:
        with self._lock:
            self._reserved -= count

    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecParams | None = None,
        reservation: Reservation | None = None,
        group: str | None = None,
    ) -> AsyncGenerator[StepOutput, None]:
        """The request's outputs up to its finished one; leaving early aborts it. Without a
        ``reservation`` (the caller's admission) it reserves its own. ``group``: the client
        request it belongs to (the engine caps what one group holds at once)."""
        with self.reserve(1) if reservation is None else contextlib.nullcontext():
            with self._lock:
                if self._closed:
                    raise NotAcceptingError("the engine is not accepting requests")
                if request_id in self._channels:
                    raise ValueError(f"duplicate request id {request_id!r}")
                ch = self._channels[request_id] = Channel(
                    asyncio.get_running_loop(), self.max_buffered
                )
            self._inbox.put(Add(request_id, prompt_ids, params, spec, group))
            self._wake.set()
            finished = False
            try:
                while not finished:
                    item = await ch.get()
                    finished = isinstance(item, BaseException) or item.finished
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                self._channels.pop(request_id, None)
                if not finished:  # the consumer went away (disconnect, cancel): stop the work
                    self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))
        self._wake.set()

    def stats(self) -> dict:
        """The engine's :class:`EngineLoad` as a dict (metrics gauges, ``/ready``)."""
        return dataclasses.asdict(self.engine.load())

    def forward_paths(self) -> dict[str, str]:
        """The engine's forward paths now (read at a metrics scrape, not after every step: they
        change only when a fast path falls back)."""
        return self.engine.forward_paths()

    # -- the engine thread ----------------------------------------------------------------------
    def _send(self, request_id: str, item: StepOutput | Exception) -> None:
        if (ch := self._channels.get(request_id)) is not None:
            ch.put(item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, Abort):
                self.engine.abort(cmd.request_id)
                continue
            rid = cmd.request_id
            try:
                self.engine.add_request(rid, cmd.prompt_ids, cmd.params, cmd.spec, cmd.group)
            except Exception:  # fail it alone; the server validated it first, so this is
                # internal: the text goes to the log, not the client
                log.exception("engine refused request %s", rid)
                self._send(rid, EngineError("the engine could not start this request"))

    def _run(self) -> Exception | None:
        """The engine loop; on its way out, every open request is answered. Returns what killed
        the loop, if anything did."""
        try:
            if not self.warmed.is_set():
                try:
                    self.engine.warm_up()  # compile failures fall back to eager inside
                except Exception:
                    log.exception("warm-up failed")
                self.warmed.set()
            self._loop()
        except Exception as e:
            log.exception("the engine loop died")
            self.healthy = False
            self._close(EngineError("the engine stopped"))
            return e
        self._close(DrainTimeoutError(CUT))
        return None

    def _holds_requests(self) -> bool:
        """Admitted requests not over yet: reserved (a submission may still be on its way),
        registered, or in the inbox."""
        return self._reserved > 0 or bool(self._channels) or not self._inbox.empty()

    def stalled_for(self) -> float:
        """Seconds the engine loop has made no progress while holding requests (0: it holds
        none, or came round since the last one arrived): a hung step shows here (``/health``)."""
        if not self.running or not self._holds_requests():
            return 0.0
        return max(0.0, time.monotonic() - self.beat)

    def _loop(self) -> None:
        e = self.engine
        while (deadline := self._drain_deadline) is None or (
            self._holds_requests() and time.monotonic() < deadline
        ):
            self.beat = time.monotonic()
            self._drain_inbox()
            if not e.has_work():
                self._wake.wait(0.5 if deadline is None else 0.05)
                self._wake.clear()
                continue
            in_step = e.held_ids() + e.waiting_ids()
            try:
                outputs = e.step()
            except Exception:  # a model step failed: fail what was in it, keep serving
                log.exception("engine step failed")
                self._fail_step(in_step)
                continue
            # Observers (the metrics) count the step before its outputs go out: a client that
            # has its answer and then scrapes /metrics finds that answer counted.
            stats = self.stats() if self.observers else {}
            for observe in self.observers:
                try:
                    observe(outputs, stats)
                except Exception:  # an observer must never stop the engine
                    log.exception("step observer failed")
            for out in outputs:
                self._send(out.request_id, out)

    def _fail_step(self, known: list[str]) -> None:
        """After a failed step: fail every request the step held or took from the queue (its
        outputs of that step are lost); requests still waiting for a slot stay queued."""
        still_waiting = set(self.engine.waiting_ids())
        err = EngineError("the engine failed while generating this response")
        for rid in known:
            if rid not in still_waiting:
                self.engine.abort(rid)
                self._send(rid, err)

    def _answer_all(self, err: EngineError) -> None:
        """Refuse new work and answer every open request with ``err`` (any thread: a drain's
        deadline timer calls it while the engine thread may still be inside a step)."""
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
        for ch in channels:
            ch.put(err)

    def _close(self, err: EngineError) -> None:
        """The loop is over: refuse new work, answer every open request with ``err``, free what
        the engine still holds."""
        self._answer_all(err)
        self.running = False
        try:
            for rid in self.engine.held_ids() + self.engine.waiting_ids():
                self.engine.abort(rid)
        except Exception:
            log.exception("could not free the engine's requests")
