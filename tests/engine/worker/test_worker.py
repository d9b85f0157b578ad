"""The async engine worker: concurrent requests share rounds and each produces exactly what it
produces alone; joins, aborts, admission (reservations), faults, chunked prefill, shutdown and a
dying engine loop. No test waits on the clock: each waits for the event it needs (an output,
a request that completes after an abort in the same inbox)."""

import asyncio
import threading
from contextlib import aclosing

import pytest

from engine.records.params import SamplingParams, SpecParams
from engine.worker.worker import EngineError, EngineWorker, NotAcceptingError, QueueFullError
from tests.helpers import assert_speculated, engine_for

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


async def collect(worker, rid, prompt, params, k, outs=None, started=None):
    """The request's tokens; ``outs`` gets its outputs, ``started`` is set at the first one."""
    toks = []
    async for o in worker.submit(rid, prompt, params, SpecParams(enabled=k > 0, k=k)):
        toks += o.new_token_ids
        if outs is not None:
            outs.append(o)
        if started is not None:
            started.set()
    return toks


def run(coro):
    return asyncio.run(coro)


def drafts(outs) -> list[tuple[int, int]]:
    """(drafted, accepted) of each output's round (a merged output's rounds summed)."""
    return [(o.stats.drafted, o.stats.accepted) for o in outs if o.stats is not None]


def settle(w):
    """Return once every abort sent so far has landed: the inbox is FIFO, so a request submitted
    now completes only after the engine took the earlier commands."""
    run(collect(w, "settle", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1), 0))


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_concurrent_equals_alone(models, drafter):
    ref = alone(models, drafter)
    e = engine_for(models, drafter)
    w = EngineWorker(e)
    w.start()
    try:
        outs: list = []

        async def main():
            return await asyncio.gather(
                *(collect(w, f"r{i}", p, sp, k, outs) for i, (p, sp, k) in enumerate(REQUESTS))
            )

        got = run(asyncio.wait_for(main(), 120))
    finally:
        w.shutdown()
    assert got == ref
    assert_speculated(drafts(outs))  # the rounds they shared drafted, accepted and rejected
    assert e.target.cache.used_tokens() == 0 and e.target.cache.num_free() == 8


def test_join_mid_flight_and_abort_leaves_others_unchanged(models):
    ref = alone(models)
    e = engine_for(models)
    w = EngineWorker(e)
    w.start()
    outs: list = []

    async def main():
        first = asyncio.create_task(collect(w, "a", *REQUESTS[0][:2], REQUESTS[0][2]))
        victim_outs = []
        v_started = asyncio.Event()

        async def victim():
            params = SamplingParams(temperature=0, max_tokens=200)
            async with aclosing(w.submit("v", list(range(5, 30)), params, SpecParams(k=3))) as it:
                async for o in it:
                    victim_outs.append(o)
                    v_started.set()
                    if len(victim_outs) == 3:
                        return  # stop reading: the worker must abort it

        v = asyncio.create_task(victim())
        await v_started.wait()  # the others join while a and v are running
        rest = [
            asyncio.create_task(collect(w, f"r{i}", p, sp, k, outs))
            for i, (p, sp, k) in enumerate(REQUESTS[1:], 1)
        ]
        await v
        return [await first] + [await t for t in rest]

    try:
        got = asyncio.run(main())
        settle(w)  # the victim's abort has landed
        assert not e.has_work()
    finally:
        w.shutdown()
    assert got == ref
    assert_speculated(drafts(outs))
    assert not e.running and not e.prefilling and e.target.cache.used_tokens() == 0
    assert e.drafter.cache.used_tokens() == 0


def test_admission_reserves_room_atomically_until_released(models):
    e = engine_for(models, slots=2)
    w = EngineWorker(e, max_queued=1)  # room for 3
    w.start()
    try:
        held = w.reserve(2)
        with pytest.raises(QueueFullError):
            w.reserve(2)
        one = w.reserve(1)
        with pytest.raises(QueueFullError):
            w.reserve(1)
        assert w.in_flight == 3
        held.release()
        held.release()  # idempotent
        assert w.in_flight == 1
        with w.reserve(2):
            assert w.in_flight == 3
        one.release()
        assert w.in_flight == 0

        async def main():  # submits without a reservation take their own, when they start
            gens = [
                w.submit(f"q{i}", [1, 2, 3], SamplingParams(temperature=0, max_tokens=50))
                for i in range(4)
            ]
            firsts = [await g.__anext__() for g in gens[:3]]
            with pytest.raises(QueueFullError):
                await gens[3].__anext__()
            assert w.in_flight == 3
            for g in gens[:3]:
                await g.aclose()
            assert w.in_flight == 0
            return firsts

        assert len(run(main())) == 3
        settle(w)  # the aborts of the closed requests have landed
        assert not e.has_work() and e.target.cache.used_tokens() == 0
    finally:
        w.shutdown()


def test_a_reservation_covers_its_submits(models):
    e = engine_for(models, "ngram", slots=1)
    w = EngineWorker(e, max_queued=0)
    w.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=5)

        async def main():
            with w.reserve(1) as room:
                out = [
                    t
                    async for o in w.submit("r", [1, 2, 3], params, SpecParams(k=2), room)
                    for t in o.new_token_ids
                ]
                with pytest.raises(QueueFullError):  # its own reservation: no room left
                    await w.submit("s", [1, 2, 3], params).__anext__()
            return out

        assert len(run(main())) == 5 and w.in_flight == 0
    finally:
        w.shutdown()


def test_worker_turns_unhealthy_when_the_engine_loop_dies(models):
    e = engine_for(models, "ngram")
    w = EngineWorker(e)
    calls = {"n": 0}
    real = e.has_work

    def broken():  # outside a step: nothing catches it but the loop's own guard
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("the loop itself failed")
        return real()

    e.has_work = broken
    w.start()
    try:

        async def main():
            with pytest.raises(EngineError):  # an open request is answered, not left hanging
                await collect(w, "x", [1, 2, 3], SamplingParams(temperature=0, max_tokens=9), 2)

        run(asyncio.wait_for(main(), 60))
        w._thread.join(30)
        assert not w.healthy and not w.running
        with pytest.raises(NotAcceptingError):
            w.reserve(1)
    finally:
        del e.has_work
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


def test_observers_count_a_step_before_its_outputs_reach_the_requests(models):
    """The metrics observe a step before its outputs are sent: a client that has its answer and
    then scrapes /metrics finds every token of it counted (sent first, a scrape could race the
    engine thread and miss the last step)."""
    e = engine_for(models)
    w = EngineWorker(e)
    events: list[tuple[str, int]] = []
    real_send = w._send

    def send(rid, item):
        events.append(("send", len(getattr(item, "new_token_ids", ()))))
        real_send(rid, item)

    w._send = send
    w.observers.append(lambda outs, stats: events.append(("observe", len(outs))))
    w.start()
    try:
        toks = run(collect(w, "o", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12), 3))
    finally:
        w.shutdown()
    assert len(toks) == 12
    # each step reads ("observe", n) and then its n sends, never a send before its observation
    i = steps = 0
    while i < len(events):
        kind, n = events[i]
        assert kind == "observe", events[: i + 1]
        assert [k for k, _ in events[i + 1 : i + 1 + n]] == ["send"] * n
        i, steps = i + 1 + n, steps + 1
    assert steps > 1 and sum(n for k, n in events if k == "send") == 12


def test_chunked_prefill_is_exact_and_interleaves(models):
    """A long prompt prefilled 16 tokens a step while a short request keeps decoding; greedy
    output equals target-only greedy. (The draft model is the target's first 2 layers: the
    conftest's one-layer draft never agrees with the target at greedy.)"""
    long_prompt = list(range(1, 60)) * 3  # 177 tokens
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = engine_for(models, None).generate([long_prompt], params)[0].output_ids
    e = engine_for(models, "layers", chunk=16, num_layers=2)
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
    assert_speculated([seq, short])
    assert steps_while_prefilling >= 5  # the short stream kept going during the long prefill


def test_graceful_shutdown_finishes_running_then_refuses(models):
    e = engine_for(models)
    w = EngineWorker(e)
    w.start()

    async def main():
        started = asyncio.Event()
        params = SamplingParams(temperature=0, max_tokens=30)
        t = asyncio.create_task(collect(w, "s", [1, 2, 3], params, 2, started=started))
        await started.wait()  # the request is running
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, w.shutdown, 30)
        return await t

    out = run(main())
    assert len(out) == 30 and not w.running
    with pytest.raises(NotAcceptingError):
        w.reserve(1)


def test_run_here_serves_then_drains_on_shutdown(models):
    """The server's layout: the engine loop runs in the calling thread (``run_here``, the main
    thread in ``specd serve``), requests come from another thread's event loop, and
    ``shutdown(wait=False)`` (a signal handler) lets the running request finish, then the loop
    returns and new requests are refused."""
    w = EngineWorker(engine_for(models))
    ref = alone(models)[0]
    result = {}

    def client():
        async def main():
            await asyncio.to_thread(w.warmed.wait, 60)  # the loop runs (no warm-up to do)
            prompt, params, k = REQUESTS[0]
            started = asyncio.Event()
            t = asyncio.create_task(collect(w, "a", prompt, params, k, started=started))
            await started.wait()  # running
            w.shutdown(30, wait=False)
            result["out"] = await t

        asyncio.run(main())

    th = threading.Thread(target=client)
    th.start()
    w.run_here()  # returns once drained
    th.join(10)
    assert result["out"] == ref
    with pytest.raises(NotAcceptingError):
        w.reserve(1)


def test_drain_waits_for_every_admitted_request_then_ends(models):
    """A drain refuses new work at once (``accepting`` false, ``draining`` true) and ends the
    loop only when every admitted request is over: one queued behind the only slot and one
    admitted (reserved) whose submission comes after the drain started both get their whole
    output."""
    e = engine_for(models, "none", slots=1)
    w = EngineWorker(e)
    w.start()
    params = SamplingParams(temperature=0, max_tokens=12)

    async def main():
        room = w.reserve(1)  # admitted; its submission arrives only after the drain began
        started = asyncio.Event()
        first = asyncio.create_task(collect(w, "a", [1, 2, 3], params, 0, started=started))
        queued = asyncio.create_task(collect(w, "b", [4, 5, 6], params, 0))
        await started.wait()
        w.shutdown(60, wait=False)
        assert w.draining and not w.accepting
        with pytest.raises(NotAcceptingError, match="shutting down"):
            w.reserve(1)
        late = []
        with room:
            sp = SpecParams(enabled=False)
            async for o in w.submit("c", [7, 8, 9], params, sp, room):
                late += o.new_token_ids
        return await first, await queued, late

    outs = run(asyncio.wait_for(main(), 120))
    assert [len(o) for o in outs] == [12, 12, 12]
    w._thread.join(30)
    assert not w.running


def test_drain_deadline_answers_what_is_left_with_drain_timeout(models):
    """Past the deadline the loop ends and each request still open gets a DrainTimeoutError
    (an error the server turns into a 503 event), never silence."""
    from engine.requests.admission import DrainTimeoutError

    e = engine_for(models, "none", slots=1)
    w = EngineWorker(e)
    w.start()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        started = asyncio.Event()
        t = asyncio.create_task(collect(w, "long", [1, 2, 3], params, 0, started=started))
        q = asyncio.create_task(collect(w, "queued", [4, 5], params, 0))
        await started.wait()
        w.shutdown(0.0, wait=False)  # the deadline is now: both are still open
        return await asyncio.gather(t, q, return_exceptions=True)

    got = run(asyncio.wait_for(main(), 60))
    assert all(isinstance(g, DrainTimeoutError) for g in got), got
    w._thread.join(30)
    assert not w.running and w.healthy


def test_drain_deadline_answers_even_while_a_step_outlasts_it(models):
    """On a loaded CPU one step can outlast the whole drain: the deadline's timer answers every
    open request on time from its own thread, and the loop still ends when the step returns."""
    from engine.requests.admission import DrainTimeoutError

    e = engine_for(models, "none", slots=1)
    inside, release = threading.Event(), threading.Event()
    step = e.step

    def slow_step():
        if w.draining:  # the first step after the drain began hangs until released
            inside.set()
            release.wait(30)
        return step()

    e.step = slow_step
    w = EngineWorker(e)
    w.start()
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        started = asyncio.Event()
        t = asyncio.create_task(collect(w, "long", [1, 2, 3], params, 0, started=started))
        await started.wait()
        w.shutdown(0.3, wait=False)
        got = await asyncio.gather(t, return_exceptions=True)
        return got, inside.is_set(), w.running  # answered while the step still hangs

    got, was_inside, running = run(asyncio.wait_for(main(), 60))
    assert isinstance(got[0], DrainTimeoutError) and was_inside and running
    release.set()
    w._thread.join(30)
    assert not w.running and w.healthy
