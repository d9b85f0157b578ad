"""Fault injection through the HTTP server: a drafter that raises costs no token (the response is
the one speculation off gives) and shows in specd_drafter_failures_total."""

import json
import logging

import httpx
import pytest

from server.settings import ServerSettings
from tests.conftest import MODEL, QUIET, idle, make_app, serving, wait_until
from tests.server.helpers import scrape, total

pytestmark = pytest.mark.real_model


@pytest.mark.drafter_faults  # the fault is injected: it must not fail the test (tests/conftest.py)
def test_drafter_fault_falls_back_exactly_and_is_counted(live, monkeypatch):
    body = {
        "model": MODEL,
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Repeat exactly: red green blue red green blue"}],
    }
    with httpx.Client(base_url=live.base_url, timeout=120) as c:
        plain = c.post("/chat/completions", json={**body, "speculation": {"enabled": False}}).json()
        before = total(
            scrape(httpx.get(f"{live.url}/metrics").text), "specd_drafter_failures_total"
        )

        def boom(*a, **k):
            raise RuntimeError("injected drafter fault")

        monkeypatch.setattr(live.engine.drafter, "propose", boom)
        r = c.post("/chat/completions", json={**body, "speculation": {"k": 4}})
        monkeypatch.undo()
        assert r.status_code == 200
        got = r.json()
        assert got["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        assert got["usage"]["speculation"]["drafted_tokens"] == 0
        after = total(scrape(httpx.get(f"{live.url}/metrics").text), "specd_drafter_failures_total")
        assert after == before + 1
        again = c.post("/chat/completions", json={**body, "speculation": {"k": 4}}).json()
        assert (
            again["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        )
        assert again["usage"]["speculation"]["drafted_tokens"] > 0  # the drafter is back


def sse_texts(lines, n: int) -> list[str]:
    """Per-choice text of a chat completion stream (SSE lines), which must end with [DONE]."""
    texts = [""] * n
    last = None
    for line in lines:
        if not line.startswith("data: "):
            continue
        last = line[6:]
        if last == "[DONE]":
            break
        for c in json.loads(last)["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
    assert last == "[DONE]"
    return texts


def test_stalled_reader_does_not_block_the_engine_and_loses_nothing(built, live, monkeypatch):
    """A client opens a big stream (2 choices x 200 tokens with top-20 logprobs: over half a
    megabyte of events) and reads nothing: the server's writes block (16 KiB send buffer), its
    per-request buffers (4 outputs here) merge, and meanwhile
    another request is served exactly and the stalled request itself runs to its end in the
    engine (KV cache freed). Then the client reads: every token is there."""
    engine, worker = live.engine, live.worker
    msgs = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]
    big = {
        "model": MODEL,
        "max_tokens": 200,
        "temperature": 0,
        "messages": msgs,
        "speculation": {"enabled": False},
    }  # one output per token: many outputs
    monkeypatch.setattr(worker, "max_buffered", 4)
    other = {
        "model": MODEL,
        "max_tokens": 24,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Name three colors."}],
    }
    with httpx.Client(base_url=live.base_url, timeout=1800) as c:
        ref_big = c.post("/chat/completions", json=big).json()["choices"][0]["message"]["content"]
        ref_other = c.post("/chat/completions", json=other).json()["choices"][0]["message"][
            "content"
        ]
        patient = ServerSettings(**QUIET, stream_send_timeout_s=3600)  # never drops the reader
        with (
            serving(make_app(built, worker), patient, sndbuf=16384) as url,
            httpx.Client(base_url=f"{url}/v1", timeout=1800) as stalled,
            stalled.stream(
                "POST",
                "/chat/completions",
                json={**big, "n": 2, "stream": True, "logprobs": True, "top_logprobs": 20},
            ) as r,
        ):
            assert r.status_code == 200  # headers read; the body is left unread
            got = c.post("/chat/completions", json=other).json()
            assert got["choices"][0]["message"]["content"] == ref_other
            wait_until(lambda: idle(engine), what="the stalled request's end in the engine")
            merged = sum(ch.merged for ch in list(worker._channels.values()))
            assert merged > 0  # the reader really stalled: outputs were merged, not queued
            assert sse_texts(r.iter_lines(), 2) == [ref_big, ref_big]


@pytest.fixture
def uvicorn_errors():
    """ERROR records of uvicorn's error logger (where an incomplete response would be logged).
    Attach after the server started (uvicorn's config resets its loggers' handlers)."""

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.records: list[logging.LogRecord] = []

        def emit(self, record):
            self.records.append(record)

    handler = Records()
    logger = logging.getLogger("uvicorn.error")
    yield handler, logger
    logger.removeHandler(handler)


def test_stream_closed_when_the_reader_stalls_past_the_send_timeout(built, live, uvicorn_errors):
    """After ``stream_send_timeout_s`` without the client taking a write, the server drops the
    connection: its request is aborted in the engine (KV slot and admission freed) long before
    max_tokens, and nothing is logged as an error (a slow client is not an alert)."""
    engine, worker = live.engine, live.worker
    app = make_app(built, worker)
    settings = ServerSettings(**QUIET, stream_send_timeout_s=1.0)
    body = {
        "model": MODEL,
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 20,
        "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
    }
    handler, logger = uvicorn_errors
    with (
        serving(app, settings, sndbuf=16384) as url,
        httpx.Client(base_url=f"{url}/v1", timeout=300) as stalled,
    ):
        logger.addHandler(handler)
        with stalled.stream("POST", "/chat/completions", json=body) as r:
            assert r.status_code == 200
            wait_until(lambda: engine.load().running > 0, what="the request's start")
            wait_until(
                lambda: idle(engine) and not worker._channels and worker.in_flight == 0,
                what="the stalled stream's end",
            )
        m = scrape(httpx.get(f"{url}/metrics").text)
    assert total(m, "specd_sequences_finished_total", finish_reason="abort") == 2
    assert total(m, "specd_sequences_finished_total") == 2
    assert total(m, "specd_output_tokens_total") < 2 * 900
    assert not handler.records, [r.getMessage() for r in handler.records]
