"""Scheduling (engine/requests/scheduler.py): slot admission, chunked prefill, and fairness across
requests — one request with many choices never holds the whole engine."""

import time

import pytest

from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import Status
from engine.requests import scheduler
from tests.helpers import engine_for, fed_prompt_tokens


def test_a_request_with_many_choices_leaves_room_for_others(models):
    e = engine_for(models, "ngram", slots=8)
    big = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(24):  # one client request, 24 choices
        e.add_request(f"big-{i}", [1, 2, 3, 4 + i % 5], big, SpecParams(k=2), group="big")
    e.step()
    e.step()
    small = e.add_request("small", [9, 8, 7], SamplingParams(temperature=0, max_tokens=4))
    steps = 0
    while small.status is not Status.FINISHED:
        held = [s for s in e.running + e.prefilling if s.group == "big"]
        assert len(held) <= e.scheduler.max_slots_per_group < 8
        e.step()
        steps += 1
    # the small request got a slot at once and needed at most one step per token
    assert steps <= 4
    while e.has_work():
        e.step()
    assert e.target.cache.used_tokens() == 0


def test_a_chat_request_beside_a_bulk_one_runs_in_the_lowest_slots(models, monkeypatch):
    """With ``bulk_slots`` = 1, a one-sequence request arriving beside a 24-choice request
    preempts the big one's rows but its lowest, takes the next slot, and its rounds are two rows
    wide; the preempted rows resume a grace period after it and every choice decodes as plain
    greedy does."""
    monkeypatch.setattr(scheduler, "BULK_GRACE_S", 0.3)
    e = engine_for(models, "ngram", slots=8, prefix_cache=256, bulk_slots=1)
    plain = engine_for(models[0], None, slots=8)
    big = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3, 4 + i % 5] * 5 for i in range(24)]
    seqs = [
        e.add_request(f"big-{i}", p, big, SpecParams(k=2), group="big")
        for i, p in enumerate(prompts)
    ]
    for _ in range(4):
        e.step()
    assert len(e.running) == e.scheduler.max_slots_per_group
    small = e.add_request("small", [9, 8, 7], SamplingParams(temperature=0, max_tokens=6))
    widths = []
    while small.status is not Status.FINISHED:
        e.step()
        if small.status is not Status.FINISHED:
            assert small.slot == 1  # the big request keeps slot 0 only
            widths.append(len(e.running))
    assert widths and max(widths) == 2
    assert e.load().preemptions >= e.scheduler.max_slots_per_group - 1
    e.step()  # within the grace period the big request keeps its one slot ...
    assert len(e.running) + len(e.prefilling) == 1
    time.sleep(scheduler.BULK_GRACE_S)
    e.step()  # ... then its rows come back
    assert len(e.running) + len(e.prefilling) > 1
    while e.has_work():
        e.step()
    want = plain.generate(prompts, big)
    assert [s.output_ids for s in seqs] == [w.output_ids for w in want]
    assert (
        small.output_ids
        == plain.generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=6))[0].output_ids
    )
    assert any(s.preemptions and s.cached_tokens for s in seqs)  # resumed from the cache
    assert e.target.cache.used_tokens() == 0 and e.target.cache.num_free() == 8


def test_a_lone_request_still_uses_its_share_of_the_slots(models):
    e = engine_for(models, "ngram", slots=8)
    for i in range(8):
        p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        e.add_request(f"c-{i}", [1, 2, 3], p, group="g")
    for _ in range(3):  # two prefill seats per group and step
        e.step()
    assert len(e.running) + len(e.prefilling) == e.scheduler.max_slots_per_group == 6
    while e.has_work():
        e.step()


def test_chunked_prefill_feeds_at_most_the_budget_per_step(models):
    e = engine_for(models, "ngram", slots=4, chunk=16)
    long = e.add_request("long", list(range(1, 60)), SamplingParams(temperature=0, max_tokens=3))
    chunks = e.scheduler.schedule_prefill()
    assert [len(c.tokens) for c in chunks] == [16]
    for _ in range(3):
        e.step()
    assert long.output_ids == [] and long.slot >= 0
    e.step()  # the last chunk (11 tokens) completes the prompt and samples the first token
    assert len(long.output_ids) >= 1
    while e.has_work():
        e.step()
    assert e.target.cache.used_tokens() == 0


def test_abort_frees_slots_in_every_state(models):
    e = engine_for(models, "model", slots=2)
    p = SamplingParams(temperature=0, max_tokens=50)
    for rid in ("a", "b", "c"):
        e.add_request(rid, [1, 2, 3, 4], p)
    e.step()
    assert {s.request_id for s in e.waiting} == {"c"}
    assert e.abort("c") and e.abort("a") and not e.abort("zzz")
    e.step()
    assert e.abort("b")
    assert not e.has_work() and e.target.cache.used_tokens() == 0
    assert e.drafter.cache.used_tokens() == 0


def run(engine, prompt, params, group, n, spec=None):
    seqs = [
        engine.add_request(f"{group}-{i}", prompt, p, spec, group) for i, p in enumerate(params)
    ]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs[:n]]


@pytest.mark.parametrize("drafter", ["model", "ngram", None])
def test_choices_of_one_prompt_share_one_prefill(models, drafter):
    prompt = [5, 9, 2, 2, 7, 31, 8, 2, 40, 13, 9, 1, 3]
    greedy = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 4
    seeded = [
        SamplingParams(temperature=1, max_tokens=8, ignore_eos=True, seed=i) for i in range(4)
    ]
    e = engine_for(models, drafter, slots=8, chunk=5)
    fed = fed_prompt_tokens(e)
    shared = run(e, prompt, greedy, "g", 4, SpecParams(k=3)) + run(
        e, prompt, seeded, "s", 4, SpecParams(k=3)
    )
    assert sum(fed) == 2 * len(prompt)  # one prefill for each request's four choices
    apart = [
        run(engine_for(models, drafter, slots=8, chunk=5), prompt, [p], "x", 1, SpecParams(k=3))[0]
        for p in greedy + seeded
    ]
    assert shared == apart  # each choice as if it had prefilled alone
    assert e.target.cache.used_tokens() == 0


def test_followers_of_an_aborted_lead_prefill_themselves(models):
    e = engine_for(models, "model", slots=8, chunk=4)
    fed = fed_prompt_tokens(e)
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompt = list(range(1, 12))
    seqs = [e.add_request(f"c-{i}", prompt, p, SpecParams(k=2), "g") for i in range(3)]
    e.step()  # the lead's first chunk; the others wait for it
    assert [s.lead for s in seqs] == [None, seqs[0], seqs[0]]
    assert e.abort("c-0")
    while e.has_work():
        e.step()
    assert seqs[1].output_ids == seqs[2].output_ids and len(seqs[1].output_ids) == 5
    assert sum(fed) == 4 + len(prompt)  # the lead's chunk, then one new lead's whole prompt
    assert e.target.cache.used_tokens() == 0 and e.drafter.cache.used_tokens() == 0
