"""The default config's drafter (EAGLE-3 head + n-gram copies) through requests that end early,
over HTTP: a stream whose client disconnects mid-way (2 choices sharing one prefill: the head's
features forked) and a non-streamed request whose client goes away (an abort), both speculating
beside other requests that run on. The others' outputs are plain decoding's, token for token;
requests that start afterwards, in the freed slots, too; the head's per-slot state and both KV
caches are empty afterwards, and speculation ran in every request, the aborted ones included.

Exact comparisons on the bf16 server send ``"deterministic": true`` (tests/server/conftest.py):
the aborted requests run in the same batch-invariant forwards."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.conftest import MODEL, idle, wait_until
from tests.helpers import assert_speculated
from tests.server.helpers import scrape, total

pytestmark = pytest.mark.real_model

SPEC = {"k": 3}
OTHERS = [  # (endpoint, body): the head drafts the chats, n-gram copies the repeated text
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "List the days of the week."}]},
    ),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Name three fruits."}]}),
    ("/completions", {"prompt": "red green blue. red green blue. red green blue. red"}),
]
LATE = [  # started once the aborted requests' slots are free
    ("/chat/completions", {"messages": [{"role": "user", "content": "Name a primary color."}]}),
    ("/completions", {"prompt": "one two three, one two three, one two"}),
]
DISCONNECTED = {  # a stream the client leaves after a few events
    "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
    "n": 2,
    "max_tokens": 900,
}
ABORTED = {"prompt": "Once upon a time", "max_tokens": 900}  # a non-streamed request left


def text_of(endpoint: str, choice: dict) -> str:
    return choice["message"]["content"] if endpoint == "/chat/completions" else choice["text"]


async def streamed(c: httpx.AsyncClient, endpoint: str, body: dict) -> tuple[str, tuple[int, int]]:
    """A whole stream's text and its usage's (drafted, accepted)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    async with c.stream("POST", endpoint, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for ch in chunk["choices"]:
                text += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
            if chunk.get("usage"):
                s = chunk["usage"]["speculation"]
                usage = (s["drafted_tokens"], s["accepted_tokens"])
    assert usage is not None
    return text, usage


@pytest.mark.slow
def test_disconnect_and_abort_mid_speculation_leave_the_others_exact(live_default):
    server = live_default
    engine, worker = server.engine, server.worker
    head = engine.drafter.eagle  # HybridDrafter: the head keeps a state per slot
    common = {"model": MODEL, "temperature": 0, "max_tokens": 40, **server.exact}
    others = [(ep, {**common, **b}) for ep, b in OTHERS]
    late = [(ep, {**common, **b}) for ep, b in LATE]
    with httpx.Client(base_url=server.base_url, timeout=600) as c:
        plain = [
            text_of(
                ep, c.post(ep, json={**b, "speculation": {"enabled": False}}).json()["choices"][0]
            )
            for ep, b in others + late
        ]
    before = scrape(httpx.get(f"{server.url}/metrics").text)
    held_at_abort: list[int] = []

    async def main():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as c:
            running = [
                asyncio.create_task(streamed(c, ep, {**b, "speculation": SPEC})) for ep, b in others
            ]
            left = asyncio.create_task(
                c.post("/completions", json={**common, **ABORTED, "speculation": SPEC})
            )
            body = {**common, **DISCONNECTED, "stream": True, "speculation": SPEC}
            async with c.stream("POST", "/chat/completions", json=body) as r:
                assert r.status_code == 200
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: {")
                    # every request holds a slot (3 others, 2 choices, the non-streamed one)
                    # and the stream has had a few rounds: leave it, and the non-streamed one
                    if events >= 6 and engine.load().running == len(others) + 3:
                        break
                held_at_abort.append(engine.load().running)
                assert not left.done()
                left.cancel()  # closes its connection
            with pytest.raises(asyncio.CancelledError):
                await left
            # the two requests' three slots free up while the others run: new requests take them
            wait_until(lambda: engine.load().running <= len(others), timeout=300, what="the aborts")
            after = [
                asyncio.create_task(streamed(c, ep, {**b, "speculation": SPEC})) for ep, b in late
            ]
            return await asyncio.gather(*running, *after)

    results = asyncio.run(asyncio.wait_for(main(), 900))
    assert held_at_abort == [len(others) + 3]
    assert [text for text, _ in results] == plain  # every other request exact, late ones too
    usage = [u for _, u in results]
    drafted, _ = assert_speculated(usage, can_reject=True)
    for u in usage:  # each of them drafted, the head's rows and the copies
        assert u[0] > 0, usage
    wait_until(
        lambda: idle(engine) and worker.in_flight == 0 and not worker._channels,
        timeout=300,
        what="every request's end",
    )
    # nothing is left of the ended requests: target KV, the head's KV and its pending features
    assert engine.target.cache.used_tokens() == 0
    assert engine.target.cache.num_free() == engine.target.cache.num_slots
    assert head.cache.num_free() == head.cache.num_slots and head.cache.used_tokens() == 0
    assert not (head.pending or head.pending_n or head.real or head.skipped)
    m = scrape(httpx.get(f"{server.url}/metrics").text)
    # the ended requests drafted too, before they ended
    drafted_all = total(m, "specd_draft_tokens_total") - total(before, "specd_draft_tokens_total")
    assert drafted_all > drafted
    aborted = [
        total(x, "specd_sequences_finished_total", finish_reason="abort") for x in (before, m)
    ]
    assert aborted[1] - aborted[0] == 3  # the two choices of the stream, the non-streamed one
