"""The async engine worker: concurrent requests share rounds and each produces exactly what it
produces alone; joins, aborts, queue limits, faults, chunked prefill and shutdown."""

import asyncio

import pytest

from engine.sampling import SamplingParams
from engine.sequence import SpecParams
from engine.worker import EngineError, EngineWorker, NotAcceptingError, QueueFullError
from tests.engine.conftest import engine_for

REQUESTS = [  # (prompt, params, K): different lengths, greedy and seeded sampling, mixed K
    ([1, 2, 3], SamplingParams(temperature=0, max_tokens=20), 3),
    (list(range(10, 40)), SamplingParams(temperature=1.0, seed=1, max_tokens=25), 2),
    ([7] * 5, SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=15), 4),
    (list(range(40, 47)), SamplingParams(temperature=0, max_tokens=30), 0),
    ([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=1.2, top_k=10, seed=3, max_tokens=18), 5),
]


def alone(models, drafter="model"):
    out = []
    for prompt, params, k in REQUESTS:
        e = engine_for(models, drafter)
        out.append(e.generate([prompt], params, SpecParams(enabled=k > 0, k=k))[0].output_ids)
    return out


async def collect(worker, rid, prompt, params, k, outs=None):
    toks = []
    async for o in worker.submit(rid, prompt, params, SpecParams(enabled=k > 0, k=k)):
        toks += o.new_token_ids
        if outs is not None:
            outs.append(o)
    return toks


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_concurrent_equals_alone(models, drafter):
    ref = alone(models, drafter)
    e = engine_for(models, drafter)
    w = EngineWorker(e)
    w.start()
    try:

        async def main():
            return await asyncio.gather(
                *(collect(w, f"r{i}", p, sp, k) for i, (p, sp, k) in enumerate(REQUESTS))
            )

        got = run(asyncio.wait_for(main(), 120))
    finally:
        w.shutdown()
    assert got == ref
    assert e.target.cache.used_tokens() == 0 and e.target.cache.num_free() == 8


def test_join_mid_flight_and_abort_leaves_others_unchanged(models):
    ref = alone(models)
    e = engine_for(models)
    w = EngineWorker(e)
    w.start()

    async def main():
        first = asyncio.create_task(collect(w, "a", *REQUESTS[0][:2], REQUESTS[0][2]))
        victim_outs = []

        async def victim():
            async for o in w.submit(
                "v",
                list(range(5, 30)),
                SamplingParams(temperature=0, max_tokens=200),
                SpecParams(k=3),
            ):
                victim_outs.append(o)
                if len(victim_outs) == 3:
                    return  # stop reading: the worker must abort it

        v = asyncio.create_task(victim())
        await asyncio.sleep(0.05)  # the others join while a and v are running
        rest = [
            asyncio.create_task(collect(w, f"r{i}", p, sp, k))
            for i, (p, sp, k) in enumerate(REQUESTS[1:], 1)
        ]
        await v
        return [await first] + [await t for t in rest]

    try:
        got = asyncio.run(main())
        for _ in range(100):  # the abort lands between rounds
            if not e.has_work():
                break
            asyncio.run(asyncio.sleep(0.02))
    finally:
        w.shutdown()
    assert got == ref
    assert not e.running and not e.prefilling and e.target.cache.used_tokens() == 0
    assert e.drafter.cache.used_tokens() == 0


def test_queue_limit(models):
    e = engine_for(models, slots=2)
    w = EngineWorker(e, max_queued=1)
    w.start()
    try:
        w.check_admission(3)
        with pytest.raises(QueueFullError):
            w.check_admission(4)

        async def main():
            gens = [
                w.submit(f"q{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
                for i in range(4)
            ]
            firsts = [await g.__anext__() for g in gens[:3]]
            with pytest.raises(QueueFullError):
                await gens[3].__anext__()
            for g in gens[:3]:
                await g.aclose()
            return firsts

        assert len(run(main())) == 3
        for _ in range(100):
            if not e.has_work():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert e.target.cache.used_tokens() == 0
    finally:
        w.shutdown()


def test_step_fault_fails_running_requests_and_worker_keeps_serving(models):
    e = engine_for(models)
    w = EngineWorker(e)
    w.start()
    real = e.step
    calls = {"n": 0}

    def faulty():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real()

    e.step = faulty
    try:
        with pytest.raises(EngineError):
            run(collect(w, "f", [1, 2, 3], SamplingParams(temperature=0, max_tokens=40), 2))
        assert e.target.cache.used_tokens() == 0
        del e.step
        ok = run(collect(w, "g", *REQUESTS[0][:2], REQUESTS[0][2]))
        assert ok == alone(models)[0]
    finally:
        w.shutdown()


def test_chunked_prefill_is_exact_and_interleaves(models):
    long_prompt = list(range(1, 60)) * 3  # 177 tokens
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = engine_for(models).generate([long_prompt], params, SpecParams(k=3))[0].output_ids
    e = engine_for(models, chunk=16)
    short = e.add_request(
        "s", [1, 2, 3], SamplingParams(temperature=0, max_tokens=40), SpecParams(k=2)
    )
    e.step()  # short is running
    seq = e.add_request("l", long_prompt, params, SpecParams(k=3))
    steps_while_prefilling = 0
    while seq.output_ids == [] and e.has_work():
        before = len(short.output_ids)
        e.step()
        if seq.output_ids == [] and len(short.output_ids) > before:
            steps_while_prefilling += 1
    while e.has_work():
        e.step()
    assert seq.output_ids == ref
    assert steps_while_prefilling >= 5  # the short stream kept going during the long prefill


def test_graceful_shutdown_finishes_running_then_refuses(models):
    e = engine_for(models)
    w = EngineWorker(e)
    w.start()

    async def main():
        t = asyncio.create_task(
            collect(w, "s", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30), 2)
        )
        await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, w.shutdown, 30)
        return await t

    out = run(main())
    assert len(out) == 30 and not w.running
    with pytest.raises(NotAcceptingError):
        w.check_admission(1)


def test_run_here_serves_then_drains_on_request_shutdown(models):
    """The server's layout: the engine loop runs in the calling thread (``run_here``, the main
    thread in ``specd serve``), requests come from another thread's event loop, and
    ``request_shutdown`` (a signal handler) lets the running request finish, then the loop
    returns and new requests are refused."""
    import threading

    w = EngineWorker(engine_for(models))
    ref = alone(models)[0]
    result = {}

    def client():
        async def main():
            while not w.running:
                await asyncio.sleep(0.01)
            prompt, params, k = REQUESTS[0]
            t = asyncio.create_task(collect(w, "a", prompt, params, k))
            await asyncio.sleep(0.02)
            w.request_shutdown(30)
            result["out"] = await t

        asyncio.run(main())

    th = threading.Thread(target=client)
    th.start()
    w.run_here()  # returns once drained
    th.join(10)
    assert result["out"] == ref
    with pytest.raises(NotAcceptingError):
        w.check_admission(1)
