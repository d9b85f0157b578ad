"""The app's health routes follow the engine loop: ``/ready`` answers 503 once the loop died (an
exception that escaped it, not a failed step), and generation is refused; ``/health`` stays up."""

import threading

import pytest
from fastapi.testclient import TestClient

from engine.engine import EngineLoad
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
