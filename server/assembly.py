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
import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from engine.worker import EngineWorker

from .app import create_app
from .convert import EngineCapacity
from .settings import ServerSettings
from .transport import uvicorn_config

if TYPE_CHECKING:
    from engine.builder import Built

log = logging.getLogger("specd.server")
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def engine_capacity(built: Built) -> EngineCapacity:
    engine, drafter = built.engine, built.config.drafter
    return EngineCapacity(engine.target.max_len, engine.vocab_size, drafter.method, drafter.k_max)


def assemble(built: Built, settings: ServerSettings, *, engine_thread: bool) -> Server:
    """The server of ``built`` (its worker admits ``config.max_queued`` beyond the slots)."""
    worker = EngineWorker(built.engine, max_queued=built.config.max_queued)
    model = built.config.model.name
    capacity = engine_capacity(built)
    grammars = (
        built.engine.grammars
    )  # read-only after start: shared by HTTP's checks and the engine
    app = create_app(worker, built.tokenizer, model, capacity, settings, grammars=grammars)
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
        self._http = _Uvicorn(uvicorn_config(self.app, self.settings))
        self._thread = threading.Thread(
            target=self._http.run, kwargs={"sockets": [sock]}, name="specd-http", daemon=True
        )
        self._thread.start()
        if not (self._http.up.wait(STARTUP_TIMEOUT_S) and self._http.started):
            self._http.should_exit = True
            raise RuntimeError(f"the HTTP server did not start on {self.url}")
        if self.worker is not None and self.engine_thread:
            self.worker.start()

    def stop(self) -> None:
        """Stop HTTP, then the engine loop (a main-thread loop is asked to end and drains)."""
        if self._http is not None:
            self._http.should_exit = True
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
        if self.worker is not None:
            self.worker.shutdown(wait=self.engine_thread)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, announce: Callable[[str], None] | None = None) -> None:
        """Serve until SIGINT / SIGTERM or until HTTP stops, the engine loop in this (the main)
        thread unless ``engine_thread``; a signal lets open requests finish (up to 10 s).
        ``announce`` gets the base URL once HTTP serves (its port known)."""
        done = threading.Event()

        def stop(*_) -> None:
            if self.worker is not None:
                self.worker.shutdown(wait=False)
            if self._http is not None:
                self._http.should_exit = True
            done.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)
        self.start()
        if announce is not None:
            announce(self.url)
        assert self._thread is not None
        http = self._thread

        def watch() -> None:  # HTTP ending (e.g. a fatal error) stops the engine too
            http.join()
            stop()

        threading.Thread(target=watch, daemon=True).start()
        try:
            if self.worker is not None and not self.engine_thread:
                self.worker.run_here()
            else:
                done.wait()
        finally:
            self.stop()
