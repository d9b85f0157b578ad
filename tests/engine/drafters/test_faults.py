"""Fault injection: a failing drafter falls back to plain decoding (output still exact, fault
counted); a failing target step fails only the requests in it; a stalled reader never blocks the
engine (its outputs merge in a bounded buffer, losslessly)."""

import asyncio

import pytest
import torch

from engine.drafters.base import Proposal
from engine.records.params import SamplingParams, SpecParams
from engine.worker.worker import EngineError, EngineWorker
from tests.helpers import assert_speculated, engine_for

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)), [7] * 5]
GREEDY = SamplingParams(temperature=0, max_tokens=30)


@pytest.fixture(scope="module")
def ref(models):
    """Target-only greedy outputs of PROMPTS (computed once per module)."""
    e = engine_for(models, None)
    return [s.output_ids for s in e.generate(PROMPTS, GREEDY, SpecParams(enabled=False))]


def idle(e):
    return (
        not e.has_work()
        and e.target.cache.used_tokens() == 0
        and (
            e.drafter is None
            or not hasattr(e.drafter, "cache")
            or e.drafter.cache.used_tokens() == 0
        )
    )


@pytest.mark.drafter_faults
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_drafter_that_always_raises_falls_back_to_exact_plain_decoding(models, ref, drafter):
    e = engine_for(models, drafter)

    def boom(*a, **k):
        raise RuntimeError("injected drafter fault")

    e.drafter.propose = boom
    seqs = e.generate(PROMPTS, GREEDY, SpecParams(k=3))
    assert [s.output_ids for s in seqs] == ref
    assert e.drafter_failures == 1  # one batched propose failed; its rows then decode plainly
    assert all(s.drafted == 0 and not s.spec.enabled for s in seqs)
    assert idle(e)


@pytest.mark.drafter_faults
def test_drafter_failing_mid_propose_keeps_output_exact_and_later_requests_speculate(models, ref):
    """A draft model whose forward fails inside a propose (the target's first 2 layers: it
    agrees with the target at times, so the later request accepts drafts and rejects some)."""
    e = engine_for(models, "layers", num_layers=2)
    runner = e.drafter.runner
    real = runner.forward
    calls = {"n": 0}

    def flaky(*a, **k):  # the first calls prefill the prompts; call 6 is inside a propose
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected draft forward fault")
        return real(*a, **k)

    runner.forward = flaky
    seqs = e.generate(PROMPTS, GREEDY, SpecParams(k=3))
    assert [s.output_ids for s in seqs] == ref
    assert e.drafter_failures == 1
    del runner.forward
    again = e.generate(PROMPTS[:1], GREEDY, SpecParams(k=3))[0]  # a new request drafts again
    assert again.output_ids == ref[0]
    assert_speculated([again], can_reject=True)
    assert idle(e)


@pytest.mark.drafter_faults
@pytest.mark.parametrize("fault", ["add", "commit", "remove", "malformed"])
def test_other_drafter_faults_are_exact_and_counted(models, ref, fault):
    e = engine_for(models, "model")
    d = e.drafter
    if fault == "malformed":
        d.propose = lambda seqs, plan: Proposal(
            torch.zeros(len(seqs) + 1, 2, dtype=torch.long), [2] * len(seqs), None
        )
    else:

        def boom(*a, **k):
            raise RuntimeError(f"injected {fault} fault")

        setattr(d, fault, boom)
    seqs = e.generate(PROMPTS, GREEDY, SpecParams(k=3))
    assert [s.output_ids for s in seqs] == ref
    assert e.drafter_failures >= 1
    assert not e.has_work() and e.target.cache.used_tokens() == 0


async def collect(w, rid, prompt, params, spec=None, rounds=None):
    """The request's tokens; ``rounds`` gets (drafted, accepted) of each output's rounds."""
    toks = []
    async for o in w.submit(rid, prompt, params, spec or SpecParams(k=2)):
        toks += o.new_token_ids
        if rounds is not None and o.stats is not None:
            rounds.append((o.stats.drafted, o.stats.accepted))
    return toks


def test_drafter_warm_up_failure_leaves_the_engine_serving(models, ref, caplog):
    """A drafter whose warm-up (its compile) raises is logged; the engine still serves exactly."""
    e = engine_for(models, "ngram")

    def broken():
        raise RuntimeError("compile failed")

    e.drafter.warm_up = broken
    e.warm_up()
    assert "drafter warm-up failed" in caplog.text
    seqs = e.generate(PROMPTS, GREEDY, SpecParams(k=3))
    assert [s.output_ids for s in seqs] == ref
    assert_speculated(seqs)  # it still drafts: a failed warm-up is no fault of its rounds


def test_target_step_fault_fails_only_the_requests_in_the_step(models, ref):
    """One KV slot: 'a' runs, 'b' waits for the slot. The step fails: 'a' gets an error, 'b'
    (not in the step) still completes exactly, and the worker serves the next request."""
    e = engine_for(models, "ngram", slots=1)
    w = EngineWorker(e)
    real = e.step
    calls = {"n": 0}

    def faulty():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected target fault")
        return real()

    e.step = faulty
    w.start()
    try:
        rounds: list = []

        async def main():
            a = asyncio.create_task(collect(w, "a", PROMPTS[0], GREEDY))
            await asyncio.sleep(0)  # 'a' is submitted first
            b = asyncio.create_task(collect(w, "b", PROMPTS[1], GREEDY, rounds=rounds))
            return await asyncio.gather(a, b, return_exceptions=True)

        a, b = asyncio.run(asyncio.wait_for(main(), 60))
        assert isinstance(a, EngineError) and "injected" not in str(a)
        assert b == ref[1]
        assert asyncio.run(collect(w, "c", PROMPTS[2], GREEDY, rounds=rounds)) == ref[2]
        assert_speculated(rounds)  # b and c drafted (n-gram, K = 2): a speculative match
        assert e.target.cache.used_tokens() == 0
    finally:
        w.shutdown()


def test_stalled_reader_does_not_block_the_engine_and_loses_nothing(models, ref):
    long = SamplingParams(temperature=0, max_tokens=120)
    ref_long = engine_for(models, None).generate([PROMPTS[0]], long, SpecParams(enabled=False))[0]
    e = engine_for(models, "ngram")
    w = EngineWorker(e, max_buffered=4)
    w.start()
    try:
        rounds: list = []

        async def main():
            stalled = w.submit("stalled", PROMPTS[0], long, SpecParams(k=2))
            first = await stalled.__anext__()  # read one output, then stop reading
            other = await collect(w, "other", PROMPTS[1], GREEDY, rounds=rounds)
            while e.has_work():  # the stalled request runs to its end in the engine
                await asyncio.sleep(0.01)
            ch = w._channels["stalled"]
            buffered, merged = len(ch.items), ch.merged
            rest = [t async for o in stalled for t in o.new_token_ids]  # the reader comes back
            return other, first.new_token_ids + rest, buffered, merged

        other, stalled_out, buffered, merged = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        w.shutdown()
    assert other == ref[1]
    assert stalled_out == ref_long.output_ids
    assert_speculated(rounds)
    assert buffered <= 4 and merged > 0
    assert e.target.cache.used_tokens() == 0
