"""HTTP test helpers: the OpenAI error shape, a small chat body, metrics scraped with
prometheus-client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in r.text and "/work/" not in r.text
    return err


def scrape(text: str) -> dict:
    """{(name, frozenset(labels)): value} of every sample (prometheus-client's own parser)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)
