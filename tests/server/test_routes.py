"""Admission of the generation routes: one check, where the room is reserved, before any byte of
the response. Requests that arrive together get either a complete 200 stream or a 429 with
Retry-After, never a 200 followed by an error event; exactly the capacity gets a 200."""

import asyncio
import json
import threading

import httpx
import pytest

from server import protocol as P
from tests.conftest import MODEL, idle, wait_until

pytestmark = pytest.mark.real_model

N = 40
BODY = {
    "model": MODEL,
    "max_tokens": 4,
    "temperature": 0,
    "stream": True,
    "messages": [{"role": "user", "content": "Say hello."}],
}


def test_concurrent_streams_get_a_whole_200_or_a_429_before_any_byte(live, monkeypatch):
    worker, engine = live.worker, live.engine
    wait_until(lambda: worker.in_flight == 0 and idle(engine), what="an idle server")
    monkeypatch.setattr(worker, "max_queued", 2)
    capacity = engine.num_slots + 2
    # no engine step runs until every response has its status: nothing finishes early, so
    # the number of 200s cannot depend on how fast this machine is
    gate, real_step = threading.Event(), engine.step

    def gated_step():
        gate.wait()
        return real_step()

    monkeypatch.setattr(engine, "step", gated_step)

    async def main():
        answered = 0
        limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
        async with httpx.AsyncClient(base_url=live.base_url, timeout=300, limits=limits) as c:

            async def one():
                nonlocal answered
                async with c.stream("POST", "/chat/completions", json=BODY) as r:
                    answered += 1
                    if answered == N:
                        gate.set()
                    return r.status_code, r.headers.get("retry-after"), (await r.aread()).decode()

            return await asyncio.gather(*(one() for _ in range(N)))

    try:
        results = asyncio.run(asyncio.wait_for(main(), 600))
    finally:
        gate.set()
    ok = [body for status, _, body in results if status == 200]
    refused = [(status, retry, body) for status, retry, body in results if status != 200]
    assert len(ok) == capacity, sorted(status for status, _, _ in results)
    for status, retry, body in refused:
        assert status == 429 and int(retry) >= 1
        err = json.loads(body)["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    for body in ok:
        datas = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
        assert datas[-1] == "[DONE]"
        chunks = [json.loads(d) for d in datas[:-1]]
        assert not any("error" in c for c in chunks), body
        for c in chunks:
            P.ChatCompletionChunk.model_validate(c)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    wait_until(lambda: worker.in_flight == 0 and idle(engine), what="every request's end")
