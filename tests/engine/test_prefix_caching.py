"""Automatic prefix caching through the engine (fp32 tiny models): a multi-turn conversation, each
turn resending the history, decodes greedily exactly as an engine without the cache does, with
speculation on (n-gram; a draft model, the target's first layers; the EAGLE-3 head), while the
later turns are served from the cache (cached_tokens > 0 and fewer prompt tokens computed);
after the pool forgot blocks; with the n choices of one request; and in deterministic mode a
hit's logprobs are bit-identical to a recompute's."""

import itertools

import pytest
import torch

from engine.records.params import SamplingParams, SpecParams
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, echo_head
from tests.helpers import assert_speculated, engine_for, fed_prompt_tokens, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BS = 16


def user_turn(turn: int, n: int = 21, vocab: int = 60) -> list[int]:
    g = torch.Generator().manual_seed(100 + turn)
    return torch.randint(1, min(vocab, 60), (n,), generator=g).tolist()


def conversation(engine, turns: int, spec: SpecParams, params=GREEDY, on_step=None):
    """Each turn's prompt is the history (prompts and answers so far) and a new user turn."""
    history: list[int] = []
    seqs = []
    for turn in range(turns):
        prompt = history + user_turn(turn, vocab=engine.vocab_size)
        s = engine.generate([prompt], params, spec, on_step=on_step)[0]
        seqs.append(s)
        history = prompt + s.output_ids
    return seqs


def engines(models, drafter, **kw):
    """The same engine with the prefix cache (256 positions) and without; ``layers``: a draft
    model of the target's first 2 layers (it agrees with the target at times)."""
    kw = {"num_layers": 2, **kw}
    return (
        engine_for(models, drafter, slots=4, max_len=256, prefix_cache=256, **kw),
        engine_for(models, drafter, slots=4, max_len=256, **kw),
    )


@pytest.mark.parametrize("drafter", ["ngram", "layers", "eagle3"])
def test_a_conversation_served_from_the_cache_decodes_as_without_it(models, drafter):
    kw = {}
    if drafter == "eagle3":
        target = tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)
        models, kw = target, {"head": echo_head(target)}
    on, off = engines(models, drafter, **kw)
    fed = fed_prompt_tokens(on)
    spec = SpecParams(k=3)
    cached = conversation(on, 4, spec)
    plain = conversation(off, 4, spec)
    assert [s.output_ids for s in cached] == [s.output_ids for s in plain]
    assert_speculated(cached)
    assert cached[0].cached_tokens == 0
    for prev, s in itertools.pairwise(cached):  # each turn: every full block of the history
        computed = len(prev.prompt_ids) + len(prev.output_ids) - 1  # the last token never fed
        assert s.cached_tokens == computed // BS * BS > 0
    prompts = sum(len(s.prompt_ids) for s in cached)
    assert sum(fed) == prompts - sum(s.cached_tokens for s in cached)  # only the rest computed
    assert on.load().prefix_hits == sum(s.cached_tokens for s in cached)


def test_a_forgetful_pool_stays_exact(models):
    """A pool of 2 blocks: turns overwrite each other's blocks, hits are partial or none."""
    on = engine_for(models, "layers", slots=4, max_len=256, prefix_cache=2 * BS, num_layers=2)
    off = engine_for(models, "layers", slots=4, max_len=256, num_layers=2)
    spec = SpecParams(k=3)
    cached, plain = conversation(on, 4, spec), conversation(off, 4, spec)
    assert [s.output_ids for s in cached] == [s.output_ids for s in plain]
    assert on.scheduler.prefix.pool.evictions > 0
    assert 0 < sum(s.cached_tokens for s in cached) <= 2 * BS * 3


def test_choices_of_a_cached_prompt_share_its_prefill(models):
    on, off = engines(models, "layers")
    prompt = user_turn(0, 40)
    on.generate([prompt], GREEDY, SpecParams(k=3))  # caches the prompt's 2 full blocks
    params = [SamplingParams(temperature=0.8, max_tokens=12, seed=i) for i in range(3)]
    groups = []
    for e in (on, off):
        seqs = [
            e.add_request(f"c{i}", prompt, p, SpecParams(k=3), "g") for i, p in enumerate(params)
        ]
        while e.has_work():
            e.step()
        groups.append(seqs)
    got, want = groups
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert all(s.cached_tokens == 32 for s in got)  # the lead restored, the others copied it


def test_deterministic_hits_are_bit_identical_to_a_recompute(models):
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    runs, logprobs = [], []
    for cache in (256, 0):
        e = engine_for(models, "layers", slots=4, max_len=256, prefix_cache=cache, num_layers=2)
        e.deterministic = "always"
        lps: list = []

        def record(outs, lps=lps):
            lps.extend((o.logprobs, o.top_logprobs) for o in outs)

        runs.append(conversation(e, 3, SpecParams(k=3), params, record))
        logprobs.append(lps)
    hit, miss = runs
    assert sum(s.cached_tokens for s in hit) > 0 and sum(s.cached_tokens for s in miss) == 0
    assert [s.output_ids for s in hit] == [s.output_ids for s in miss]
    assert logprobs[0] == logprobs[1]  # bit-identical floats, every token and alternative


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_deterministic_and_ordinary_requests_keep_their_blocks_apart(models, layout):
    """``deterministic: request``: ordinary and deterministic requests of one prompt through one
    engine, alone and side by side in one batch. A deterministic request never starts on blocks
    an ordinary forward computed (their rounding may differ), only on blocks of batch-invariant
    forwards, and then answers bit-identically to a recompute; an ordinary request starts on the
    ordinary blocks. Negative control: each kind does hit its own kind's blocks, so the misses
    are the salt's, not a cold cache."""
    logprobs = {"logprobs": 2, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    plain, det = SamplingParams(**logprobs), SamplingParams(**logprobs, deterministic=True)
    e = engine_for(models, "ngram", slots=4, max_len=256, prefix_cache=256, kv_layout=layout)
    e.deterministic = "request"
    fresh = engine_for(models, "ngram", slots=4, max_len=256, kv_layout=layout)
    fresh.deterministic = "request"
    prompt = user_turn(7, 40)  # 2 full blocks, and the rest

    def ask(engine, params_list):
        lps: dict = {}

        def record(outs):
            for o in outs:
                lps.setdefault(o.request_id, []).append((o.logprobs, o.top_logprobs))

        seqs = engine.generate([prompt] * len(params_list), params_list, SpecParams(k=3), record)
        return [(s.cached_tokens, s.output_ids, lps[s.request_id]) for s in seqs]

    (recompute,) = ask(fresh, [det])  # no cache: every position computed invariantly
    (o1,) = ask(e, [plain])  # caches the prompt's blocks under the ordinary root
    (d1,) = ask(e, [det])
    (d2,) = ask(e, [det])
    o2, d3 = ask(e, [plain, det])  # side by side: one batch (the invariant forward)
    assert o1[0] == 0 and d1[0] == 0  # the ordinary blocks did not serve the deterministic one
    assert d2[0] == 32 and d3[0] == 32 and o2[0] == 32  # each kind's own blocks served it
    assert d1 == (0, *recompute[1:]) and d2[1:] == d3[1:] == recompute[1:]  # bit-identical
    assert o2[1] == o1[1] == recompute[1]  # fp32: the greedy tokens agree
