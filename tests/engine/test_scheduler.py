"""Scheduling (engine/scheduler.py): slot admission, chunked prefill, and fairness across
requests — one request with many choices never holds the whole engine."""

from engine.sampling import SamplingParams
from engine.sequence import SpecParams, Status
from tests.helpers import engine_for


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
