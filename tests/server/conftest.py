import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import uvicorn

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.worker import EngineWorker
from server.app import create_app
from server.convert import Limits
from server.limits import uvicorn_config
from server.settings import ServerSettings

MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_app(built, worker, **settings):
    cfg = built.config
    limits = Limits(
        built.engine.target.max_len, built.engine.vocab_size, cfg.drafter.method, cfg.drafter.k_max
    )
    return create_app(worker, built.tokenizer, MODEL, limits, ServerSettings(**settings))


@pytest.fixture(scope="session")
def built(real_fp32):
    cfg = EngineConfig.from_dict(
        {
            "model": {"dtype": "float32", "name": MODEL},
            "max_running": 8,
            "max_model_len": 1024,
            "drafter": {"method": "ngram", "k": 4},
        }
    )
    return build_engine(cfg, real_fp32)


@contextmanager
def serving(app, settings: ServerSettings | None = None, sndbuf: int | None = None):
    """``app`` on a real uvicorn server (specd's transport limits) on a free loopback port, in a
    thread; yields its base URL. ``sndbuf``: the connections' kernel send buffer (no autotuning),
    so that a client that stops reading blocks the server's writes early."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)  # accepted sockets inherit it
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(app, "127.0.0.1", port, settings or ServerSettings(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def live(built):
    """A real uvicorn server on a loopback port, serving the real model in fp32."""
    worker = EngineWorker(built.engine)
    worker.start()
    with serving(make_app(built, worker)) as url:
        yield SimpleNamespace(
            base_url=f"{url}/v1",
            url=url,
            worker=worker,
            engine=built.engine,
            tokenizer=built.tokenizer,
            model=built.engine.target.model,
        )
    worker.shutdown()


@pytest.fixture(scope="session")
def target_greedy(real_fp32):
    """Target-only greedy continuation of token ids by transformers' generate()."""
    model, tok = real_fp32

    def run(ids, max_tokens):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        return out[0, len(ids) :].tolist()

    return run
