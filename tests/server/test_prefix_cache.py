"""The prefix cache as an HTTP client sees it (the real model, fp32): a conversation's next turn,
which resends the history, reports the history's cached tokens in
``usage.prompt_tokens_details.cached_tokens`` on both routes, streamed and not, answers as a
recompute does, and the hits show in /metrics under specd's and vLLM's names."""

import json
import uuid

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.conftest import MODEL, make_app
from tests.server.helpers import scrape, total

pytestmark = pytest.mark.real_model


def opening() -> str:
    """A first user turn no earlier request sent (its blocks are in no cache yet)."""
    words = " ".join(uuid.uuid4().hex[:6] for _ in range(12))
    return f"Here are some codes: {words}. Please read them carefully, then answer my question."


def chat(c, messages, stream=False) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    if not stream:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        d = r.json()
        return d["choices"][0]["message"]["content"], d["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                usage = ev.get("usage") or usage
                for ch in ev.get("choices") or []:
                    text += (ch.get("delta") or {}).get("content") or ""
    assert usage is not None
    return text, usage


@pytest.mark.parametrize("stream", [False, True])
def test_the_next_turn_is_served_from_the_cache(live, built, stream):
    with TestClient(make_app(built, live.worker)) as c:
        first = [{"role": "user", "content": opening()}]
        answer, u1 = chat(c, first, stream)
        bs = built.config.prefix_block_size
        # at most the chat template's opening (its system prompt), which every chat shares
        assert u1["prompt_tokens_details"]["cached_tokens"] < u1["prompt_tokens"] // 2
        second = first + [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Which code came first?"},
        ]
        text, u2 = chat(c, second, stream)
        cached = u2["prompt_tokens_details"]["cached_tokens"]
        # every full block of the first turn's prompt, not the new turn
        assert (u1["prompt_tokens"] - 1) // bs * bs <= cached < u2["prompt_tokens"]
        assert cached % bs == 0
        # the same turn once more, its every block cached: the same greedy answer
        again, u3 = chat(c, second, stream)
        assert again == text and u3["prompt_tokens_details"]["cached_tokens"] >= cached
        m = scrape(c.get("/metrics").text)
        hits = total(m, "vllm:prefix_cache_hits_total")
        assert hits >= cached + u3["prompt_tokens_details"]["cached_tokens"]
        assert total(m, "specd_prefix_cache_hits_total") == hits
        looked_up = sum(u["prompt_tokens"] for u in (u1, u2, u3))
        assert total(m, "vllm:prefix_cache_queries_total") >= looked_up


def test_completions_report_cached_prompt_tokens(live, built):
    prompt = opening() + " The first code is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    with TestClient(make_app(built, live.worker)) as c:
        u1 = c.post("/v1/completions", json=body).json()["usage"]
        u2 = c.post("/v1/completions", json=body).json()["usage"]
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < u2["prompt_tokens_details"]["cached_tokens"] < u2["prompt_tokens"]


def test_the_default_config_serves_a_6000_token_conversation(live_default):
    """configs/default.yaml holds SmolLM2's own context: a conversation of ~6,000 tokens is
    answered, and its next turn computes only the new turn (the history from the cache)."""
    tok = live_default.tokenizer
    text = opening()
    while len(tok(text)["input_ids"]) < 6000:
        text += " " + opening()
    history = [
        {"role": "user", "content": text},
        {"role": "assistant", "content": "I have read them all."},
    ]
    with httpx.Client(base_url=live_default.base_url, timeout=600) as c:
        answer, u1 = chat_over(c, history + [{"role": "user", "content": "How many codes?"}])
        assert u1["prompt_tokens"] >= 6000
        turn = [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        _, u2 = chat_over(c, history + [{"role": "user", "content": "How many codes?"}] + turn)
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"] - 32
    root = str(live_default.base_url).removesuffix("/v1")
    ready = httpx.get(f"{root}/ready", timeout=30).json()  # the KV budget the config set
    assert ready["kv_budget_tokens"] == 65536 and ready["preemptions"] >= 0


def chat_over(c: httpx.Client, messages) -> tuple[str, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = c.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


def usage_of(c, route: str, body: dict, stream: bool) -> dict:
    """The usage of one request to ``route``, streamed (the usage chunk) or not."""
    if not stream:
        r = c.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with c.stream("POST", route, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_count_each_prompt_once(live, built, stream):
    """``usage.prompt_tokens_details.cached_tokens`` counts a prompt's cached tokens once, as
    ``prompt_tokens`` counts its tokens: the n choices of a chat request report what one choice
    does, and a /v1/completions request of several prompts reports each prompt's own. The
    controls: the hits are real (cached > 0) and the choices and prompts are several."""
    with TestClient(make_app(built, live.worker)) as c:
        messages = [{"role": "user", "content": opening()}]
        chat_body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0.7}
        usage_of(c, "/v1/chat/completions", chat_body, stream)  # caches the prompt
        one = usage_of(c, "/v1/chat/completions", chat_body, stream)
        three = usage_of(c, "/v1/chat/completions", chat_body | {"n": 3}, stream)
        cached = one["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and three["prompt_tokens"] == one["prompt_tokens"]
        assert three["prompt_tokens_details"]["cached_tokens"] == cached

        a, b = opening(), opening()
        body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
        alone = {}
        for p in (a, b):  # each prompt cached, then its own hit measured alone
            usage_of(c, "/v1/completions", body | {"prompt": p}, stream)
            alone[p] = usage_of(c, "/v1/completions", body | {"prompt": p}, stream)
        both = usage_of(c, "/v1/completions", body | {"prompt": [a, b], "n": 2}, stream)
    assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in alone.values())
    assert both["prompt_tokens"] == sum(u["prompt_tokens"] for u in alone.values())
    want = sum(u["prompt_tokens_details"]["cached_tokens"] for u in alone.values())
    assert both["prompt_tokens_details"]["cached_tokens"] == want
