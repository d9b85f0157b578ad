"""Every refused request gets OpenAI's error shape and the right status; the server stays up."""

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.worker.worker import EngineWorker, QueueFullError
from tests.conftest import MODEL, idle, make_app, wait_until
from tests.server.helpers import CHAT, assert_error, scrape, total

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def api(live, built):
    with TestClient(make_app(built, live.worker)) as c:
        yield c


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),  # wrong types
        ({"stream": "maybe"}, "stream"),
        ({"n": 1.5}, "n"),
        ({"stop": 5}, "stop"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 2**70}, "seed"),
        ({"messages": []}, "messages"),  # empty / malformed messages
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages.0"),
        ({"messages": [{"content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            None,
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),  # unknown role
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"n": 100}, "n"),
        ({"n": 0}, "n"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"five": 10}}, "logit_bias"),
        ({"logit_bias": {"49152": 10}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),  # logprobs above the cap
        ({"speculation": {"k": 99}}, "speculation.k"),
        ({"speculation": {"method": "draft"}}, "speculation.method"),
    ],
)
def test_chat_bad_fields(api, patch, param):
    r = api.post("/v1/chat/completions", json={**CHAT, **patch})
    assert_error(r, 400, param)


@pytest.mark.parametrize(
    "patch,param",
    [
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"logprobs": 6}, "logprobs"),  # above OpenAI's maximum of 5
        ({"logprobs": -1}, "logprobs"),
        ({"n": 9}, "n"),
        ({"prompt": ["x"] * 65}, "prompt"),  # prompts x n above max_choices
        ({"prompt": ["x"] * 10, "n": 8}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"echo": "sometimes"}, "echo"),
    ],
)
def test_completion_bad_fields(api, patch, param):
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **patch})
    assert_error(r, 400, param)


@pytest.mark.parametrize(
    "raw,param",
    [
        ('"temperature": NaN', "temperature"),
        ('"temperature": Infinity', "temperature"),
        ('"top_p": -Infinity', "top_p"),
        ('"presence_penalty": NaN', "presence_penalty"),
        ('"max_tokens": NaN', "max_tokens"),
        ('"logit_bias": {"5": Infinity}', "logit_bias.5"),
    ],
)
def test_nan_and_infinity_refused(api, raw, param):
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], {raw}}}'
    r = api.post(
        "/v1/chat/completions", content=body.encode(), headers={"content-type": "application/json"}
    )
    assert_error(r, 400, param)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "\xff\xfe", "prompt": "x"}',
        b'{"model": "' + MODEL.encode() + b'", "prompt": "caf\xe9"}',
        b"\xff\xfe\x00{",
    ],
)
def test_invalid_utf8_refused(api, body):
    with pytest.raises(UnicodeDecodeError):
        body.decode()
    r = api.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400)


@pytest.mark.parametrize(
    "body,ctype",
    [
        (b"[1, 2, 3]", "application/json"),  # JSON, but not an object
        (b'"prompt"', "application/json"),
        (b"", "application/json"),
        (b"{" * 100000, "application/json"),  # deeply nested garbage
        (b'{"model": "x", "prompt": "x"', "application/json"),  # truncated
    ],
)
def test_malformed_bodies(api, body, ctype):
    assert_error(api.post("/v1/completions", content=body, headers={"content-type": ctype}), 400)


def test_prompt_longer_than_context(api):
    r = api.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 2000, "max_tokens": 4})
    assert assert_error(r, 400, "prompt")["code"] == "context_length_exceeded"
    r = api.post(
        "/v1/chat/completions",
        json={**CHAT, "messages": [{"role": "user", "content": "word " * 1500}]},
    )
    assert_error(r, 400, "messages")


@pytest.mark.parametrize("prompt", [[], "", [49152], [[1, 2], [-1]]])
def test_bad_prompts(api, prompt):
    assert_error(
        api.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400, "prompt"
    )


def test_invalid_json_and_missing_fields(api):
    r = api.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(r, 400)
    assert_error(api.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    assert_error(api.post("/v1/completions", json={"prompt": "x"}), 400, "model")
    assert_error(
        api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}),
        400,
        "max_tokens",
    )


def test_best_of_and_suffix_refused(api):
    assert_error(
        api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 3}),
        400,
        "best_of",
    )
    assert_error(
        api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y"}),
        400,
        "suffix",
    )


def test_deterministic_refused_where_the_mode_is_off(api):
    body = {**CHAT, "deterministic": True}
    r = api.post("/v1/chat/completions", json=body)
    assert_error(r, 400, "deterministic")
    assert "--deterministic" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_openais_404(api, path):
    body = {**CHAT, "prompt": "x", "model": "text-davinci-003"}
    r = api.post(path, json=body)
    assert_error(r, 404, "model")
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_model_retrieve(api):
    assert api.get(f"/v1/models/{MODEL}").json() == {
        "id": MODEL,
        "object": "model",
        "created": api.get("/v1/models").json()["data"][0]["created"],
        "owned_by": "specd",
    }
    r = api.get("/v1/models/gpt-4o")
    assert_error(r, 404, "model")
    assert r.json()["error"]["code"] == "model_not_found"


def test_not_found_and_method_not_allowed(api):
    assert_error(api.get("/v1/nothing"), 404)
    assert_error(api.get("/v1/chat/completions"), 405)


def test_body_too_large(api, live):
    r = api.post(
        "/v1/completions", content=b"x" * (2 << 20), headers={"content-type": "application/json"}
    )
    assert_error(r, 413)
    # chunked (no Content-Length): refused once the received bytes pass the limit
    chunks = (b"x" * 65536 for _ in range(40))
    r = httpx.post(
        f"{live.base_url}/completions",
        content=chunks,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert_error(r, 413)


def test_still_serves_after_bad_input(api):
    """After bad input (sent here: the test does not rely on the bad-input tests above running
    first) the same server answers a good request."""
    json_type = {"content-type": "application/json"}
    for bad in (b"{not json", b"{" * 100000, b'{"model": "\xff\xfe", "prompt": "x"}'):
        api.post("/v1/completions", content=bad, headers=json_type)  # refused (tests above)
    api.post("/v1/chat/completions", json={**CHAT, "temperature": 3})
    r = api.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert api.get("/ready").json()["status"] == "ready"


def test_api_keys(built, live):
    with TestClient(make_app(built, live.worker, api_keys=["k1", "k2"])) as c:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            err = assert_error(c.get("/v1/models", headers=headers), 401)
            # OpenAI's own type, code and wording (litellm reads the wording)
            assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
            assert err["message"].startswith("Incorrect API key provided")
        assert c.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
        assert c.get("/health").status_code == 200  # liveness needs no key


def test_not_ready_until_worker_runs(built):
    idle = EngineWorker(built.engine)  # never started
    with TestClient(make_app(built, idle)) as c:
        assert_error(c.get("/ready"), 503)
        assert_error(c.post("/v1/chat/completions", json=CHAT), 503)
        assert c.get("/health").status_code == 200


def test_ready_and_health(api):
    assert api.get("/health").json() == {"status": "ok"}
    assert api.get("/ready").json()["status"] == "ready"


def finished(metrics_text: str, reason: str) -> float:
    return total(scrape(metrics_text), "specd_sequences_finished_total", finish_reason=reason)


def test_disconnect_aborts_engine_work(live):
    engine = live.engine
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = httpx.get(f"{live.url}/metrics").text
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", f"{live.base_url}/completions", json=body) as r,
    ):
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
            if got >= 2:
                break
        assert engine.load().running == 1, "the request should be running in the engine"
    wait_until(lambda: idle(engine) and live.worker.in_flight == 0, what="the abort")
    after = httpx.get(f"{live.url}/metrics").text
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert finished(after, "length") == finished(before, "length")  # it did not run to its end


def test_non_stream_disconnect_aborts(live):
    """The client goes away as soon as its request runs in the engine (no client timeout: an
    event, not a guess at how long 900 tokens take)."""
    engine = live.engine
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "temperature": 0}
    before = httpx.get(f"{live.url}/metrics").text

    async def leave_once_running():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(c.post(f"{live.base_url}/completions", json=body))
            while engine.load().running == 0:
                assert not task.done(), task.result().text
                await asyncio.sleep(0.02)
            task.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave_once_running())
    wait_until(lambda: idle(engine) and live.worker.in_flight == 0, what="the abort")
    after = httpx.get(f"{live.url}/metrics").text
    assert finished(after, "abort") == finished(before, "abort") + 1
    assert finished(after, "length") == finished(before, "length")


def test_engine_failure_mid_stream_sends_error_event_and_server_recovers(live):
    import openai

    client = openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=60)
    engine = live.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:  # fail once, after the stream has started
            raise RuntimeError("injected fault /secret/path")
        return real_step()

    engine.step = failing_step
    try:
        stream = client.chat.completions.create(
            model=MODEL,
            stream=True,
            max_tokens=200,
            temperature=0,
            messages=[{"role": "user", "content": "Count from one to one hundred."}],
        )
        with pytest.raises(openai.APIError) as exc:
            for _ in stream:
                pass
        assert "secret" not in str(exc.value) and "engine failed" in str(exc.value)
    finally:
        del engine.step  # back to the class method
    wait_until(lambda: idle(engine) and live.worker.in_flight == 0, what="the failed request's end")
    r = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0, messages=[{"role": "user", "content": "hi"}]
    )
    assert r.choices[0].message.content


class FullWorker:
    running = healthy = True
    warmed = SimpleNamespace(is_set=lambda: True)

    def __init__(self):
        self.observers = []

    def reserve(self, count):
        raise QueueFullError("the server is at capacity (request queue full); retry later")

    def stats(self):
        return {}


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_429_at_once(built, stream):
    with TestClient(make_app(built, FullWorker())) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        err = assert_error(r, 429)
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
