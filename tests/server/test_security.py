"""Security posture: no internals in responses, CORS off unless configured, header and body read
deadlines, constant-time API-key comparison."""

import socket

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import server.middleware as middleware_module
import server.routes as routes_module
from server.settings import ServerSettings
from tests.conftest import MODEL, QUIET, make_app, serving
from tests.server.helpers import CHAT, assert_error

pytestmark = pytest.mark.real_model


def test_internal_exception_leaks_nothing(built, live, monkeypatch):
    def explode(*a, **k):
        raise RuntimeError("/srv/secret/path.py line 7: password=hunter2")

    monkeypatch.setattr(routes_module, "chat_job", explode)
    with TestClient(make_app(built, live.worker), raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        err = assert_error(r, 500)
        assert err["type"] == "server_error" and err["message"] == "internal server error"
        assert "secret" not in r.text and "hunter2" not in r.text and "RuntimeError" not in r.text
        monkeypatch.undo()
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_engine_refusal_text_stays_in_the_log(built, live, monkeypatch):
    engine = live.engine

    def refuse(*a, **k):
        raise RuntimeError("/srv/secret/engine.py: internal detail")

    monkeypatch.setattr(engine, "add_request", refuse)
    with TestClient(make_app(built, live.worker)) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert_error(r, 500)
        assert "secret" not in r.text and "internal detail" not in r.text


def test_cors_off_by_default(built, live):
    with TestClient(make_app(built, live.worker)) as c:
        r = c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = c.options(
            "/v1/chat/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in r.headers


def test_cors_only_for_configured_origins(built, live):
    ok = "https://app.example"
    with TestClient(make_app(built, live.worker, cors_origins=[ok], api_keys=["k"])) as c:
        r = c.options(
            "/v1/chat/completions",
            headers={
                "Origin": ok,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ok
        r = c.get("/v1/models", headers={"Origin": ok, "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == ok
        r = c.get(
            "/v1/models", headers={"Origin": "https://evil.example", "Authorization": "Bearer k"}
        )
        assert "access-control-allow-origin" not in r.headers


def test_api_key_compare_is_constant_time(built, live, monkeypatch):
    calls = []
    real = middleware_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware_module.hmac, "compare_digest", spy)
    with TestClient(make_app(built, live.worker, api_keys=["k1", "k2"])) as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer k3"}), 401)
    assert len(calls) == 4  # every key compared, whichever matched


def test_wrong_api_key_is_the_sdks_authentication_error(built, live):
    with serving(make_app(built, live.worker, api_keys=["k1"])) as url:
        for key in ("wrong", "k"):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                client.models.list()
            assert e.value.code == "invalid_api_key" and "bad request" not in str(e.value).lower()
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        assert [m.id for m in ok.models.list().data] == [MODEL]


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture(scope="module")
def strict(built, live):
    """A live server with short header and body deadlines."""
    settings = ServerSettings(
        **QUIET, header_timeout_s=0.5, body_timeout_s=0.5, max_header_bytes=4096
    )
    with serving(make_app(built, live.worker, body_timeout_s=0.5), settings) as url:
        yield url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def test_slow_request_head_is_cut_off(strict):
    with connect(strict) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert read_all(s) == b""  # closed by the server, nothing answered
    with connect(strict) as s:  # an idle connection (nothing sent) is closed too
        assert read_all(s) == b""
    assert httpx.get(f"{strict}/health").status_code == 200


def test_slow_body_gets_408(strict):
    with connect(strict) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model":'
        )  # 10 of 100 bytes, then nothing
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply


def test_oversized_head_is_refused(strict):
    with connect(strict) as s:
        # an unfinished head past max_header_bytes (h11 limits what it buffers of one event)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000)
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 400")


def test_keep_alive_connection_serves_requests_within_the_deadline(strict):
    # one connection, several requests; the read timeout bounds a hang only (the first request
    # to the live engine may wait for its start-up calibration)
    with httpx.Client(base_url=strict, timeout=httpx.Timeout(5.0, read=600.0)) as c:
        for _ in range(3):
            assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
