"""Pieces of the load generator that need no server: token spreading, percentiles, intervals,
workloads and how both load shapes end."""

import asyncio
import json
import statistics

import pytest

from loadtest import stats, workloads
from loadtest.client import Record, tokens_per_chunk
from loadtest.shapes import closed_loop, open_loop


def test_tokens_per_chunk_sums_and_floors():
    assert tokens_per_chunk([3, 3, 3], 3) == [1, 1, 1]
    assert tokens_per_chunk([2, 2], 1) == [1, 1]  # a server that sends fewer tokens than chunks
    split = tokens_per_chunk([10, 1, 20, 9], 20)
    assert sum(split) == 20 and min(split) >= 1 and split[2] > split[0] > split[1]
    assert tokens_per_chunk([], 5) == []


def test_percentiles_match_statistics_quantiles():
    xs = [0.001 * i for i in range(1, 102)]
    p = stats.percentiles(xs)
    q = statistics.quantiles(xs, n=100, method="inclusive")
    assert p["p50_ms"] == pytest.approx(1000 * q[49])
    assert p["p99_ms"] == pytest.approx(1000 * q[98])
    assert p["p50_ms"] <= p["p90_ms"] <= p["p95_ms"] <= p["p99_ms"]
    assert stats.percentiles([])["p50_ms"] is None


def test_percentile_interpolates_between_ranks():
    shuffled = [3.0, 1.0, 4.0, 2.0]
    assert stats.percentile(shuffled, 0) == 1.0 and stats.percentile(shuffled, 100) == 4.0
    assert stats.percentile(shuffled, 50) == pytest.approx(2.5)
    q = statistics.quantiles(shuffled, n=4, method="inclusive")
    assert [stats.percentile(shuffled, p) for p in (25, 50, 75)] == pytest.approx(q)
    assert stats.percentile([7.0], 95) == 7.0 and stats.percentile([], 50) is None
    assert stats.percentiles([None, 0.002, None])["count"] == 1


def test_mean_ci_covers_mean_and_needs_two_values():
    ci = stats.mean_ci([1.0, 1.2, 1.1, 0.9])
    lo, hi = ci["ci95"]
    assert ci["mean"] == pytest.approx(1.05)
    assert lo < ci["mean"] < hi
    # t(3) = 3.182, sd = 0.1291: half width 0.2054
    assert hi - ci["mean"] == pytest.approx(3.182 * 0.12910 / 2, rel=1e-3)
    assert stats.mean_ci([1.0])["ci95"] == [None, None]


def test_workloads_interleave_categories_and_read_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "def f(x):", "category": "code"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        + "\n"
    )
    items = workloads.build(["mtbench:2", "humaneval", f"jsonl:{path}"], per_category=2)
    cats = [it.category for it in items]
    assert len(items) == 2 * 9 + 2  # 8 MT-Bench categories + humaneval, 2 each; 2 JSONL lines
    assert len(set(cats[:11])) == 11  # the first round has one of each
    mt = [it for it in items if it.id.startswith("mtbench")]
    assert all(it.endpoint == "chat" and len(it.followups) == 1 for it in mt)
    assert all(it.endpoint == "completions" for it in items if it.category == "humaneval")
    j = next(it for it in items if it.category == "jsonl")
    assert j.max_tokens == 5 and j.messages[0]["content"] == "hi"
    as_chat = workloads.build(["humaneval"], per_category=1, endpoint="chat")[0]
    humaneval_0 = workloads.load("humaneval")[0]
    assert as_chat.endpoint == "chat"
    assert as_chat.messages == ({"role": "user", "content": humaneval_0.prompt},)
    with pytest.raises(ValueError):
        workloads.load("sharegpt")


HANG = "hang"  # an item whose request never ends by itself


async def _send(item, sink):
    """A request that ends at once, or (HANG) waits on an event nobody sets."""
    rec = Record(str(item), "x")
    sink.append(rec)
    try:
        if item == HANG:
            await asyncio.Event().wait()
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        rec.error = "cancelled: run time limit"
        raise


@pytest.mark.parametrize("shape", ["closed", "open"])
def test_load_shapes_stop_by_themselves(shape):
    items = ["fast", "fast", HANG]
    if shape == "closed":
        run = closed_loop(items, _send, concurrency=2, requests=100, duration=0.3, grace=0.2)
    else:
        run = open_loop(items, _send, rate=50.0, requests=100, duration=0.3, grace=0.2)
    # the shape cancels the hung requests itself; the outer bound only turns a hang into a failure
    records, wall = asyncio.run(asyncio.wait_for(run, timeout=120))
    hung = [r for r in records if r.error]
    assert hung and all(r.id == HANG for r in hung)
    assert all(r.error == "cancelled: run time limit" for r in hung)
    assert all(r.error is None for r in records if r.id != HANG)
    assert len(records) < 100
    s = stats.summarize(records, wall)
    assert s["cancelled"] == len(hung) and s["errors"] == 0


def test_open_loop_sends_exactly_the_requests_asked():
    records, _ = asyncio.run(open_loop(["fast"], _send, rate=200.0, requests=7, duration=10))
    assert len(records) == 7 and not any(r.error for r in records)
