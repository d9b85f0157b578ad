"""The app's health routes follow the engine loop: ``/ready`` answers 503 once the loop died (an
exception that escaped it, not a failed step), and generation is refused; ``/health`` stays up."""

import asyncio
import contextlib
import threading
import time

import pytest
from fastapi.testclient import TestClient

from engine.engine import EngineLoad
from engine.records.params import SamplingParams
from engine.worker.worker import EngineWorker
from tests.conftest import make_app
from tests.server.helpers import CHAT, assert_error

pytestmark = pytest.mark.real_model  # the real tokenizer


class DyingEngine:
    """An engine with nothing to do, whose loop dies once ``die`` is set."""

    lossless, num_slots = True, 1

    def __init__(self):
        self.die = threading.Event()

    def has_work(self) -> bool:
        if self.die.is_set():
            raise RuntimeError("the engine loop itself failed")
        return False

    def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0, 1, 1, 0)

    def needs_warm_up(self) -> bool:
        return False

    def forward_paths(self) -> dict[str, str]:
        return {"target": "eager"}

    def held_ids(self) -> list[str]:
        return []

    def waiting_ids(self) -> list[str]:
        return []

    def abort(self, request_id: str) -> bool:
        return False


def test_ready_turns_503_when_the_engine_loop_dies(built):
    engine = DyingEngine()
    worker = EngineWorker(engine)
    worker.start()
    with TestClient(make_app(built, worker)) as c:
        assert c.get("/ready").json()["status"] == "ready"
        engine.die.set()
        worker.abort("wake-up")  # the loop wakes, drains its inbox, asks for work: dies
        worker._thread.join(30)
        assert not worker._thread.is_alive() and not worker.healthy
        assert assert_error(c.get("/ready"), 503)["code"] == "not_ready"
        assert assert_error(c.post("/v1/chat/completions", json=CHAT), 503)["code"] == "not_ready"
        assert c.get("/health").status_code == 200


def test_structured_output_on_an_engine_without_grammars_is_a_400(built):
    """The app checks grammars with the engine's own compiler; an engine without one (a test
    engine, say) gets no structured request: 400 before admission, never the engine's refusal
    (a 500). Found by schemathesis: a regex request reached such an engine."""
    engine = DyingEngine()  # no ``grammars`` attribute, and it never generates
    worker = EngineWorker(engine)
    worker.start()
    try:
        with TestClient(make_app(built, worker)) as c:
            regex = CHAT | {"structured_outputs": {"regex": "[a-z]+"}}
            err = assert_error(c.post("/v1/chat/completions", json=regex), 400)
            assert err["param"] == "structured_outputs.regex" and "not available" in err["message"]
            fmt = CHAT | {"response_format": {"type": "json_object"}, "stream": True}
            assert assert_error(c.post("/v1/chat/completions", json=fmt), 400)["param"] == (
                "response_format"
            )
            assert c.get("/ready").json()["status"] == "ready"
    finally:
        worker.shutdown()


class StuckEngine(DyingEngine):
    """An engine whose step hangs until ``release`` is set (a hung kernel, a deadlock)."""

    def __init__(self):
        super().__init__()
        self.release, self.stepping = threading.Event(), threading.Event()
        self.work = False

    def add_request(self, rid, ids, params, spec, group) -> None:
        self.work = True

    def has_work(self) -> bool:
        return self.work

    def step(self):
        self.stepping.set()
        self.release.wait(30)
        self.work = False
        return []


def test_health_turns_503_while_a_hung_engine_holds_requests(built):
    """Liveness follows the engine loop's heartbeat: a step that never ends while a request is
    held turns /health 503 past ``health_stall_s`` (Kubernetes then restarts the pod); when the
    step ends it is 200 again. Idle, the loop is never stalled."""
    engine = StuckEngine()
    worker = EngineWorker(engine)
    worker.start()
    try:
        with TestClient(make_app(built, worker, health_stall_s=0.3)) as c:
            time.sleep(0.5)
            assert c.get("/health").status_code == 200  # idle: nothing held

            async def consume():  # one request held by the worker (the engine never ends it)
                params = SamplingParams(temperature=0, max_tokens=2)
                with contextlib.suppress(Exception):  # the shutdown below answers it
                    async for _ in worker.submit("held", [1, 2, 3], params):
                        pass

            threading.Thread(target=lambda: asyncio.run(consume()), daemon=True).start()
            assert engine.stepping.wait(30)
            time.sleep(0.6)
            err = assert_error(c.get("/health"), 503)
            assert err["code"] == "engine_stalled" and "no progress" in err["message"]
            engine.release.set()
            deadline = time.monotonic() + 30
            while c.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.get("/health").status_code == 200
    finally:
        engine.release.set()
        worker.shutdown(timeout=2)


def test_metrics_render_once_per_cache_period(built):
    """Scrapes within ``metrics_cache_s`` share one rendered page (the engine's stats are read
    once); after it, a new page."""
    engine = DyingEngine()
    worker = EngineWorker(engine)
    reads = []
    stats = worker.stats
    worker.stats = lambda: reads.append(1) or stats()  # type: ignore[method-assign]
    worker.start()
    try:
        with TestClient(make_app(built, worker, metrics_cache_s=0.5)) as c:
            first = c.get("/metrics").text
            assert c.get("/metrics").text == first and len(reads) == 1
            time.sleep(0.6)
            c.get("/metrics")
            assert len(reads) == 2
    finally:
        worker.shutdown(timeout=2)
