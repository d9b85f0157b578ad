"""engine/requests/prefill.py: which prompt chunks share a target forward, and that sharing one
leaves the cached keys and values, the first tokens and the greedy output as one forward a chunk
makes them."""

import random
from types import SimpleNamespace

import pytest
import torch

from engine.records.params import SamplingParams, SpecParams
from engine.requests import prefill
from engine.requests.scheduler import PrefillChunk
from tests.helpers import engine_for

pytestmark = pytest.mark.usefixtures("single_thread")


def chunk(n: int, scored: bool = False) -> PrefillChunk:
    seq = SimpleNamespace(params=SimpleNamespace(prompt_logprobs=1 if scored else None))
    return PrefillChunk(seq, 0, [5] * n)  # type: ignore[arg-type]


def scored(c: PrefillChunk) -> bool:
    return c.seq.params.prompt_logprobs is not None


def lengths(groups) -> list[list[int]]:
    return [[len(c.tokens) for c in g] for g in groups]


def test_groups_by_cap_padding_and_alone():
    assert lengths(prefill.prefill_groups([chunk(n) for n in (30, 3, 17, 9)], 512, scored)) == [
        [3, 9, 17, 30]  # shortest first; padded 120 for 59 real tokens: within SLACK
    ]
    assert lengths(prefill.prefill_groups([chunk(n) for n in (30, 3, 17, 9)], 34, scored)) == [
        [3, 9],  # 2 x 9 <= 34; 3 x 17 is over the cap
        [17],
        [30],
    ]
    # 2 x 200 padded for 204 real tokens: 196 of padding, over SLACK and a quarter
    assert lengths(prefill.prefill_groups([chunk(200), chunk(4)], 512, scored)) == [[4], [200]]
    many = prefill.prefill_groups([chunk(100), chunk(101), chunk(8, True), chunk(99)], 512, scored)
    assert lengths(many) == [[8], [99, 100, 101]]  # the scored chunk alone


def test_groups_hold_every_chunk_once_within_the_cap():
    rng = random.Random(3)
    for _ in range(300):
        cap = rng.randint(1, 600)
        chunks = [chunk(rng.randint(1, cap), rng.random() < 0.2) for _ in range(rng.randint(0, 8))]
        groups = prefill.prefill_groups(chunks, cap, scored)
        flat = [c for g in groups for c in g]
        assert sorted(map(id, flat)) == sorted(map(id, chunks))
        for g in groups:
            widest = max(len(c.tokens) for c in g)
            assert len(g) == 1 or len(g) * widest <= cap
            assert len(g) == 1 or not any(scored(c) for c in g)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in (3, 9, 17, 30, 5, 12)]


def first_step(models, prompts, together: bool, drafter):
    """The target forwards of an engine's first step (4 prompts prefill: max_prefill 4), its
    cached keys/values of those prompts, and the greedy output of every prompt."""
    e = engine_for(models, drafter)
    assert e.group_prefill == (e.device.type == "cuda")  # the default: grouped on CUDA only
    e.group_prefill = together
    forward, fed = e.target.forward, []

    def counting(tokens, slots, *a, **kw):
        fed.append(list(slots))
        return forward(tokens, slots, *a, **kw)

    e.target.forward = counting
    params = SamplingParams(temperature=0, max_tokens=16)
    seqs = [e.add_request(f"r{i}", p, params, SpecParams(k=3)) for i, p in enumerate(prompts)]
    e.step()
    first = fed[:-1]  # the last forward of the step is its round's verify
    cache = e.target.cache
    kv = [t[s.slot, :, : len(s.prompt_ids)].clone() for s in seqs[:4] for t in cache.k + cache.v]
    while e.has_work():
        e.step()
    return first, kv, [s.output_ids for s in seqs]


@pytest.mark.parametrize("drafter", [None, "model", "ngram"])
def test_prompts_of_a_step_share_one_forward_and_change_nothing(models, prompts, drafter):
    alone, kv_alone, out_alone = first_step(models, prompts, False, drafter)
    together, kv_together, out_together = first_step(models, prompts, True, drafter)
    assert len(alone) == 4 and len(together) == 1
    assert sorted(together[0]) == sorted(s for slots in alone for s in slots)
    for a, b in zip(kv_alone, kv_together, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert out_together == out_alone
    assert all(len(o) == 16 for o in out_together)
