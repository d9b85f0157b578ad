"""A request's channel: bounded, lossless (merged outputs concatenate), an exception ends it."""

import asyncio

from engine.records.output import StepOutput
from engine.records.sequence import RoundStats
from engine.worker.channel import Channel, merge_outputs


def out(tokens, finished=False, stats=None, logprobs=None):
    reason = "length" if finished else None
    return StepOutput("r", list(tokens), finished, reason, stats, logprobs=logprobs)


def stats(drafted, accepted, emitted):
    return RoundStats(2, drafted, accepted, emitted, draft_s=0.0, verify_s=0.0)


def test_merge_concatenates_tokens_logprobs_counts_and_passes():
    s = stats(2, 1, 2)
    a = out([1, 2], stats=s, logprobs=[-0.1, -0.2])
    b = out([3], finished=True, stats=stats(1, 0, 1), logprobs=[-0.3])
    m = merge_outputs(a, b)
    assert m.new_token_ids == [1, 2, 3] and m.logprobs == [-0.1, -0.2, -0.3]
    assert (m.stats.drafted, m.stats.accepted, m.stats.emitted) == (3, 1, 3)
    assert m.passes == 2 and m.finished and m.finish_reason == "length"
    assert merge_outputs(out([1]), out([2])).logprobs is None  # none asked: none given
    assert merge_outputs(out([1], stats=s), out([2])).stats == s  # a prefill token has none


def test_bounded_channel_merges_past_its_size_and_keeps_every_token():
    async def main():
        ch = Channel(asyncio.get_running_loop(), max_items=2)
        for t in range(5):
            ch.put(out([t]))
        ch.put(out([5], finished=True))
        assert len(ch.items) == 2 and ch.merged == 4
        ch.put(out([6]))  # (a finished output is never merged into)
        got = [await ch.get() for _ in range(3)]
        assert [t for o in got for t in o.new_token_ids] == list(range(7)) and got[1].finished
        err = RuntimeError("x")
        ch.put(err)
        assert await ch.get() is err

    asyncio.run(main())
