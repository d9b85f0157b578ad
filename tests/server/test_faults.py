"""Fault injection through the HTTP server: a drafter that raises costs no token (the response is
the one speculation off gives) and shows in specd_drafter_failures_total."""
import httpx
import pytest

from tests.server.conftest import MODEL
from tests.server.test_metrics import scrape, total

pytestmark = pytest.mark.real_model


def test_drafter_fault_falls_back_exactly_and_is_counted(live, monkeypatch):
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat exactly: red green blue red green blue"}]}
    with httpx.Client(base_url=live.base_url, timeout=120) as c:
        plain = c.post("/chat/completions", json={**body, "speculation": {"enabled": False}}).json()
        before = total(scrape(httpx.get(f"{live.url}/metrics").text), "specd_drafter_failures_total")

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
        assert again["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        assert again["usage"]["speculation"]["drafted_tokens"] > 0  # the drafter is back
