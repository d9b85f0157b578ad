"""The one assembly of a server from a built engine and settings: the worker, the app, uvicorn
with specd's connection limits (:func:`assemble`), and :class:`Server`, which runs them.

Threads: HTTP (uvicorn's event loop) always runs in a thread of its own. The engine loop runs
either in the main thread (``engine_thread=False``, ``specd serve``: on CPU, torch's OpenMP thread
team stays hot only for the process's main thread) or in a thread of its own
(``engine_thread=True``: tests, embedding). The listening socket is bound before HTTP starts, so
its port is known (port 0: any free port) and connections made at once wait in its backlog.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from engine.api import EngineWorker

from . import generation_defaults
from .app import create_app
from .convert import EngineCapacity
from .settings import ServerSettings
from .transport import uvicorn_config

if TYPE_CHECKING:
    from engine.api import Built

log = logging.getLogger("specd.server")
STARTUP_TIMEOUT_S = 60.0
DRAIN_FLUSH_S = 2.0  # the end of a shutdown kept for HTTP: the last events go out, sockets close
HARD_EXIT_S = 3.0  # past the shutdown timeout, a watchdog ends the process whatever holds it


def engine_capacity(built: Built, generation_config: str = "auto") -> EngineCapacity:
    """What ``built`` serves, with the sampling defaults ``generation_config`` names
    (server/generation_defaults.py; ValueError for a folder without one)."""
    engine, cfg = built.engine, built.config
    block = cfg.prefix_block_size
    cache_info = {  # vLLM's cache_config_info labels, of what specd has: positions per block,
        # the KV budget in blocks (vLLM's name says GPU; on CPU it is the same budget)
        "block_size": str(block),
        "num_gpu_blocks": str(engine.load().kv_budget_tokens // block),
        "cache_dtype": cfg.model.dtype,
        "enable_prefix_caching": str(cfg.prefix_cache_tokens > 0),
    }
    return EngineCapacity(
        engine.target.max_len,
        engine.vocab_size,
        cfg.drafter.method,
        cfg.drafter.k_max,
        cfg.deterministic,
        generation_defaults.resolve(generation_config, engine.target.model),
        cache_info,
    )


def assemble(built: Built, settings: ServerSettings, *, engine_thread: bool) -> Server:
    """The server of ``built`` (its worker admits ``config.max_queued`` beyond the slots)."""
    worker = EngineWorker(built.engine, max_queued=built.config.max_queued)
    model = built.config.model.name
    capacity = engine_capacity(built, settings.generation_config)
    if capacity.sampling_defaults:  # (vLLM says so too: answers differ from OpenAI's defaults)
        log.warning(
            "sampling defaults from the model's generation config (--generation-config %s; "
            "'vllm' turns them off): %s",
            settings.generation_config,
            capacity.sampling_defaults,
        )
    # the app checks grammars with the engine's own compiler (read-only after start)
    app = create_app(worker, built.tokenizer, model, capacity, settings)
    return Server(app, settings, worker, engine_thread=engine_thread)


class _Uvicorn(uvicorn.Server):
    """uvicorn, telling when its startup is over (:attr:`up`; then ``started`` says how)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.up = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.up.set()


class Server:
    """HTTP over ``app`` on ``settings.host:port``; with a ``worker``, its engine loop too (a
    ``worker`` of None: the app's worker is run by someone else). ``sndbuf``: the kernel send
    buffer of every connection (a small one makes a client that stops reading block the
    server's writes early)."""

    def __init__(
        self,
        app: FastAPI,
        settings: ServerSettings,
        worker: EngineWorker | None = None,
        *,
        engine_thread: bool = True,
        sndbuf: int | None = None,
    ):
        self.app, self.settings, self.worker = app, settings, worker
        self.engine_thread, self.sndbuf = engine_thread, sndbuf
        self.port = settings.port
        self._http: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self._end: float | None = None  # when a drain started must be over (monotonic)

    @property
    def url(self) -> str:
        host = self.settings.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def _bind(self) -> socket.socket:
        host = self.settings.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, self.settings.port), family=family, backlog=2048)
        if self.sndbuf:  # accepted connections inherit it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sndbuf)
        self.port = sock.getsockname()[1]
        return sock

    def start(self) -> None:
        """Bind, serve HTTP from a thread (returns once uvicorn has started), and start the
        engine thread when the engine loop runs in one."""
        sock = self._bind()
        flush = math.ceil(DRAIN_FLUSH_S)  # what uvicorn gives open connections once told to exit
        self._http = _Uvicorn(
            uvicorn_config(self.app, self.settings, timeout_graceful_shutdown=flush)
        )
        self._thread = threading.Thread(
            target=self._http.run, kwargs={"sockets": [sock]}, name="specd-http", daemon=True
        )
        self._thread.start()
        if not (self._http.up.wait(STARTUP_TIMEOUT_S) and self._http.started):
            self._http.should_exit = True
            raise RuntimeError(f"the HTTP server did not start on {self.url}")
        if self.worker is not None and self.engine_thread:
            self.worker.start()

    def drain(self, timeout: float | None = None) -> None:
        """Start a drain that ends by ``timeout`` seconds from now (default
        ``settings.shutdown_timeout_s``; a later call can only bring the end closer): the worker
        admits nothing more (``/ready`` and new requests answer 503, HTTP still listening) and
        finishes what it holds until ``DRAIN_FLUSH_S`` before the end. Returns at once."""
        timeout = self.settings.shutdown_timeout_s if timeout is None else timeout
        end = time.monotonic() + timeout
        self._end = end if self._end is None else min(self._end, end)
        if self.worker is not None:
            self.worker.shutdown(max(0.0, self._end - time.monotonic() - DRAIN_FLUSH_S), False)

    def stop(self) -> None:
        """Drain (see :meth:`drain`; the engine thread joined when it is ours), then stop HTTP:
        uvicorn closes the listener and idle connections and lets the last responses (the error
        events of cut streams among them) go out for ``DRAIN_FLUSH_S``."""
        self.drain()
        if self.worker is not None and self.engine_thread:
            self.worker.shutdown(0.0 if self._end is None else self._end - time.monotonic())
        if self._http is not None:
            self._http.should_exit = True
        if self._thread is not None:  # uvicorn gives open responses DRAIN_FLUSH_S, then exits
            self._thread.join(DRAIN_FLUSH_S + 0.5)  # (a late engine step eats no flush time)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, announce: Callable[[str], None] | None = None) -> None:
        """Serve until SIGINT / SIGTERM or until HTTP stops, the engine loop in this (the main)
        thread unless ``engine_thread``. ``announce`` gets the base URL once HTTP serves (its
        port known). The first signal drains (:meth:`drain`): the process returns once every
        request it held is over, at most ``settings.shutdown_timeout_s`` after the signal, and a
        watchdog ends it ``HARD_EXIT_S`` later if anything still holds it. A second signal
        shortens the drain to ``DRAIN_FLUSH_S``."""
        done = threading.Event()

        def on_signal(*_) -> None:
            if done.is_set():  # the second signal: cut the drain short
                self.drain(DRAIN_FLUSH_S)
                return
            log.warning("drain: %.0f s at most", self.settings.shutdown_timeout_s)
            self.drain()
            done.set()
            threading.Thread(target=self._watchdog, daemon=True, name="specd-exit").start()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        self.start()
        if announce is not None:
            announce(self.url)
        assert self._thread is not None
        http = self._thread

        def watch() -> None:  # HTTP ending (e.g. a fatal error) stops the engine too
            http.join()
            if not done.is_set():
                self.drain(0.0)
                done.set()

        threading.Thread(target=watch, daemon=True).start()
        try:
            if self.worker is not None and not self.engine_thread:
                self.worker.run_here()
            else:
                done.wait()
        finally:
            self.stop()

    def _watchdog(self) -> None:
        """After the first signal. A step can outlast the drain's end on a loaded CPU, so the
        engine thread may not get back to stop HTTP: at the end less ``DRAIN_FLUSH_S`` (the
        worker has answered every request by then, from its own timer) this thread tells HTTP to
        exit. The process then ends with 0 once HTTP has sent every answer, or with 1
        ``HARD_EXIT_S`` after the end if anything still holds it."""
        while self._end is None or time.monotonic() < self._end - DRAIN_FLUSH_S:
            time.sleep(0.1)
        if self._http is not None:
            self._http.should_exit = True
        http = self._thread
        while http is not None and http.is_alive() and time.monotonic() < self._end + HARD_EXIT_S:
            http.join(0.1)
        if http is None or not http.is_alive():
            time.sleep(0.5)  # the engine thread's chance to return on its own
            log.warning("drain over (the engine was still inside a step): exiting")
            os._exit(0)
        log.critical("shutdown timeout passed %.0f s ago: exiting now", HARD_EXIT_S)
        os._exit(1)
