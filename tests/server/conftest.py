import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from server.app import create_app
from server.assembly import Server, assemble, engine_capacity
from server.settings import ServerSettings

MODEL = "SmolLM2-135M-Instruct"
QUIET = {"port": 0, "log_level": "warning"}  # any free loopback port; uvicorn's warnings only


def make_app(built, worker, **settings):
    """An app over ``worker`` (run elsewhere) with these settings, as ``specd serve`` builds it."""
    return create_app(
        worker, built.tokenizer, MODEL, engine_capacity(built), ServerSettings(**settings)
    )


def wait_until(condition, timeout: float = 1200.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds; ``timeout`` only bounds a hang, it asserts nothing
    about speed."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not hold within {timeout} s"
        time.sleep(0.02)


def idle(engine) -> bool:
    """The engine holds and queues nothing, and its KV cache is empty."""
    load = engine.load()
    return load.running == 0 and load.waiting == 0 and load.kv_used_tokens == 0


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
    """``app`` (its worker run by someone else) on a real uvicorn server with specd's connection
    limits, on a free loopback port; yields its base URL. ``sndbuf``: the connections' kernel
    send buffer, so that a client that stops reading blocks the server's writes early."""
    with Server(app, settings or ServerSettings(**QUIET), sndbuf=sndbuf) as server:
        yield server.url


@pytest.fixture(scope="session")
def live(built):
    """The real model in fp32 served as ``specd serve`` serves it (server/assembly.py), the
    engine loop in a thread of its own."""
    with assemble(built, ServerSettings(**QUIET), engine_thread=True) as server:
        yield SimpleNamespace(
            base_url=f"{server.url}/v1",
            url=server.url,
            worker=server.worker,
            engine=built.engine,
            tokenizer=built.tokenizer,
            model=built.engine.target.model,
        )


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
