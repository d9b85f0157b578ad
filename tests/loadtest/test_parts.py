"""Pieces of the load generator that need no server: token spreading, percentiles, intervals,
workloads and the time bounds of both load shapes."""

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
    j = [it for it in items if it.category == "jsonl"][0]
    assert j.max_tokens == 5 and j.messages[0]["content"] == "hi"
    as_chat = workloads.build(["humaneval"], per_category=1, endpoint="chat")[0]
    humaneval_0 = workloads.load("humaneval")[0]
    assert as_chat.endpoint == "chat"
    assert as_chat.messages == ({"role": "user", "content": humaneval_0.prompt},)
    with pytest.raises(ValueError):
        workloads.load("sharegpt")


async def _slow_send(item, sink):
    rec = Record(str(item), "x")
    sink.append(rec)
    try:
        await asyncio.sleep(item)
    except asyncio.CancelledError:
        rec.error = "cancelled: run time limit"
        raise


@pytest.mark.parametrize("shape", ["closed", "open"])
def test_load_shapes_stop_by_themselves(shape):
    items = [0.01, 0.01, 30.0]  # the third request would hang
    if shape == "closed":
        run = closed_loop(items, _slow_send, concurrency=2, requests=100, duration=0.3, grace=0.2)
    else:
        run = open_loop(items, _slow_send, rate=50.0, requests=100, duration=0.3, grace=0.2)
    records, wall = asyncio.run(run)
    assert wall < 2.0
    hung = [r for r in records if r.error]
    assert hung and all(r.id == "30.0" for r in hung)
    assert len(records) < 100
    s = stats.summarize(records, wall)
    assert s["cancelled"] == len(hung) and s["errors"] == 0


def test_open_loop_sends_exactly_the_requests_asked():
    records, _ = asyncio.run(open_loop([0.0], _slow_send, rate=200.0, requests=7, duration=10))
    assert len(records) == 7 and not any(r.error for r in records)
