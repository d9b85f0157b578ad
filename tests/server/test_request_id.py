"""X-Request-Id and the access log, on the live fp32 server: a request's id is its X-Request-Id
(or the body's ``request_id``, or one made) -- echoed as a response header on every answer,
errors included, made the response's ``id``, and written on specd.server's log lines of the
request; two requests that send one id are both served. uvicorn's access log is off with
``access_log`` false (vLLM's --disable-uvicorn-access-log) and never has a line for the probes."""

import asyncio
import json
import logging
import re

import httpx
import pytest

from server.middleware import REQUEST_ID, RequestIdLog
from server.settings import ServerSettings
from tests.conftest import MODEL, make_app, serving
from tests.server.helpers import assert_error

pytestmark = pytest.mark.real_model

HELLO = [{"role": "user", "content": "Say hello."}]
CHAT = {"model": MODEL, "messages": HELLO, "max_tokens": 3, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.base_url, timeout=300) as c:
        yield c


def test_the_request_id_is_echoed_and_is_the_responses_id(http):
    r = http.post("/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "chatcmpl-trace-42"
    # streamed: every chunk carries it
    body = {**COMPLETION, "stream": True}
    r = http.post("/completions", json=body, headers={"X-Request-Id": "trace-43"})
    assert r.headers["x-request-id"] == "trace-43"
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert chunks and all(c["id"] == "cmpl-trace-43" for c in chunks)
    # none sent: one is made, echoed and used
    r = http.post("/completions", json=COMPLETION)
    made = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made) and r.json()["id"] == f"cmpl-{made}"
    # vLLM's body field, without a header
    r = http.post("/completions", json={**COMPLETION, "request_id": "from-body"})
    assert r.headers["x-request-id"] == "from-body" and r.json()["id"] == "cmpl-from-body"
    # the header wins over the body
    r = http.post(
        "/completions",
        json={**COMPLETION, "request_id": "from-body"},
        headers={"X-Request-Id": "from-header"},
    )
    assert r.json()["id"] == "cmpl-from-header"
    # an id a log line could be forged with is not taken: a new one is made
    r = http.post("/completions", json=COMPLETION, headers={"X-Request-Id": "a b%s"})
    assert r.headers["x-request-id"] != "a b%s" and r.json()["id"].startswith("cmpl-")
    assert_error(http.post("/completions", json={**COMPLETION, "request_id": "a b"}), 400)


def test_errors_and_other_routes_carry_it_too(http, live):
    r = http.post(
        "/completions", json={**COMPLETION, "model": "nope"}, headers={"X-Request-Id": "e1"}
    )
    assert_error(r, 404)
    assert r.headers["x-request-id"] == "e1"
    r = httpx.get(f"{live.url}/health", headers={"X-Request-Id": "probe-1"})
    assert r.headers["x-request-id"] == "probe-1"


def test_two_requests_with_one_id_are_both_served(live):
    async def main():
        async with httpx.AsyncClient(base_url=live.base_url, timeout=300) as c:
            h = {"X-Request-Id": "same"}
            return await asyncio.gather(
                *(c.post("/chat/completions", json=CHAT, headers=h) for _ in range(3))
            )

    for r in asyncio.run(main()):
        assert r.status_code == 200 and r.json()["id"] == "chatcmpl-same"
        assert r.json()["choices"][0]["message"]["content"]


def test_an_unhandled_error_is_logged_with_the_request_id(http, monkeypatch, caplog):
    import server.routes as routes

    def broken(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(routes, "completion_job", broken)
    with caplog.at_level(logging.ERROR, logger="specd.server"):
        r = http.post("/completions", json=COMPLETION, headers={"X-Request-Id": "oops-7"})
    assert_error(r, 500)
    assert r.headers["x-request-id"] == "oops-7" and "boom" not in r.text
    lines = [x.getMessage() for x in caplog.records if x.name == "specd.server"]
    assert any("unhandled error" in m and "[request oops-7]" in m for m in lines), lines


def test_the_log_filter_adds_the_id_only_inside_a_request():
    f = RequestIdLog()
    outside = logging.LogRecord("specd.server", logging.INFO, "", 0, "hello %s", ("x",), None)
    assert f.filter(outside) and outside.getMessage() == "hello x"
    token = REQUEST_ID.set("r-1")
    try:
        inside = logging.LogRecord("specd.server", logging.INFO, "", 0, "hello %s", ("x",), None)
        assert f.filter(inside) and inside.getMessage() == "hello x [request r-1]"
    finally:
        REQUEST_ID.reset(token)


@pytest.mark.parametrize("access_log", [True, False])
def test_the_access_log_skips_probes_and_can_be_turned_off(built, live, capfd, access_log):
    """uvicorn's own access handler, as ``specd serve`` runs it (its lines go to stdout)."""
    settings = ServerSettings(port=0, log_level="info", access_log=access_log)
    app = make_app(built, live.worker)
    capfd.readouterr()
    with serving(app, settings) as url:
        for path in ("/health", "/ready", "/metrics", "/v1/models", "/health?x=1"):
            assert httpx.get(url + path, timeout=60).status_code < 500
    out = capfd.readouterr()
    lines = [x for x in (out.out + out.err).splitlines() if '"GET /' in x]
    if not access_log:
        assert lines == []
        return
    assert len(lines) == 1 and "/v1/models" in lines[0], lines
