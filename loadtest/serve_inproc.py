"""Start specd in this process (engine worker + uvicorn on a free loopback port) for benchmarks."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.worker import EngineWorker
from server.app import create_app
from server.convert import Limits
from server.settings import ServerSettings


@contextmanager
def serve(cfg: EngineConfig, settings: ServerSettings | None = None):
    """Yields (base_url, built engine); stops everything on exit."""
    built = build_engine(cfg)
    engine = built.engine
    worker = EngineWorker(engine, max_queued=cfg.max_queued)
    worker.start()
    limits = Limits(engine.target.max_len, engine.vocab_size, cfg.drafter.method)
    app = create_app(worker, built.tokenizer, cfg.model.name, limits, settings or ServerSettings())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", built
    finally:
        server.should_exit = True
        thread.join(10)
        worker.shutdown(5)
