"""Speculation end to end where it was never exercised before, on tiny random models (target-only
engine or the target model itself as the reference): K other than 2, logprobs and top_logprobs
under speculation, seeded sampled requests that really speculate."""

import pytest
import torch

from engine.records.params import SamplingParams, SpecParams
from tests.distribution import target_probs
from tests.helpers import engine_for, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in (3, 9, 17, 30)]
    return ps + [[1, 2, 3, 1, 2, 3, 1, 2], [7] * 6]  # repeats: the n-gram drafter proposes


# -- K other than 2 -------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture(scope="module")
def plain_greedy(models, prompts):
    return [s.output_ids for s in engine_for(models, None).generate(prompts, GREEDY)]


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_with_k_is_exact(models, prompts, plain_greedy, drafter, k):
    e = engine_for(models, drafter)
    ks = []
    seqs = e.generate(
        prompts,
        GREEDY,
        SpecParams(k=k),
        on_step=lambda outs: ks.extend(o.stats.k for o in outs if o.stats),
    )
    assert [s.output_ids for s in seqs] == plain_greedy
    assert max(ks) == k and sum(s.drafted for s in seqs) > 0
    assert e.target.cache.used_tokens() == 0


# -- logprobs -------------------------------------------------------------------------------------
def collect_logprobs(engine, prompts, params, spec):
    lps, tops = {}, {}

    def on_step(outs):
        for o in outs:
            assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs)
            tops.setdefault(o.request_id, []).extend(o.top_logprobs)

    seqs = engine.generate(prompts, params, spec, on_step=on_step)
    return seqs, [lps[s.request_id] for s in seqs], [tops[s.request_id] for s in seqs]


def reference_logprobs(model, prompt, output, p: SamplingParams):
    """The target's processed log-probabilities at every output position (transformers' forward
    over the prompt and the output so far; temperature / top-k / top-p as the engine applies
    them, -inf as -9999)."""
    out = []
    for j in range(len(output)):
        probs = target_probs(model, prompt + output[:j], p.temperature, p.top_k, p.top_p)
        out.append(torch.log(probs).clamp_min(-9999.0))
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_tokens=12, seed=5, logprobs=5),
        SamplingParams(temperature=1.3, max_tokens=12, seed=6, logprobs=0),
    ],
    ids=["greedy", "T0.7-topk-topp", "T1.3"],
)
def test_logprobs_with_speculation_are_the_targets(models, prompts, params):
    """Plain and K = 4 (the target's first layer drafts: accepted and recovered tokens alike):
    each emitted token's logprob and the top-n alternatives are the target's processed
    log-probabilities at that position."""
    results = {}
    for name, drafter, spec in (
        ("plain", None, SpecParams(enabled=False)),
        ("k4", "layers", SpecParams(k=4)),
    ):
        e = engine_for(models, drafter, num_layers=1)
        seqs, lps, tops = collect_logprobs(e, prompts, params, spec)
        if drafter is not None:
            assert 0 < sum(s.accepted for s in seqs) < sum(s.drafted for s in seqs)
        for s, lp, top in zip(seqs, lps, tops):
            ref = reference_logprobs(models[0], s.prompt_ids, s.output_ids, params)
            assert len(lp) == len(top) == len(s.output_ids)
            for j, t in enumerate(s.output_ids):
                assert lp[j] == pytest.approx(float(ref[j][t]), abs=1e-4), (name, j)
                assert len(top[j]) == params.logprobs
                want = ref[j].topk(params.logprobs)
                got_ids = [i for i, v in top[j] if v > -9999.0]
                want_ids = [i for i, v in zip(want.indices.tolist(), want.values) if v > -9999.0]
                assert got_ids == want_ids, (name, j)
                got_v = torch.tensor([v for _, v in top[j]], dtype=torch.float64)
                torch.testing.assert_close(got_v, want.values, atol=1e-4, rtol=0)
        results[name] = [s.output_ids for s in seqs], lps
    if params.greedy:  # the same tokens, and the same logprobs, with and without speculation
        assert results["plain"][0] == results["k4"][0]
        for a, b in zip(results["plain"][1], results["k4"][1]):
            assert a == pytest.approx(b, abs=1e-4)


# -- seeded sampling with speculation ------------------------------------------------------------
@pytest.fixture(scope="module")
def sharp():
    """The target with its LM head x25: sampled tokens often follow its greedy loop, so the
    n-gram drafter's proposals are accepted at T > 0 too."""
    return tiny_llama(5, layers=3, sharpen=25.0)


@pytest.mark.parametrize("drafter", ["layers", "ngram"])
def test_seeded_request_with_forced_k_reproduces_alone_and_in_a_batch(sharp, prompts, drafter):
    """A seeded sampled request with a forced K = 3 speculates (the adaptive controller would pin
    it to K = 0) and its output is the same alone and beside other requests (unseeded, greedy,
    other seeds and K, under the default adaptive controller)."""

    def engine():
        return engine_for(sharp, drafter, num_layers=2)

    loop = engine().generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))[0]
    prompt = prompts[0] + loop.output_ids  # the target's own greedy loop: the n-gram drafter hits
    mine = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234)
    alone = engine().generate([prompt], mine, SpecParams(k=3))[0]
    assert alone.drafted > 0 and alone.accepted > 0

    others = [
        (prompts[0], SamplingParams(temperature=1.0, max_tokens=30), SpecParams()),
        (prompts[1], SamplingParams(temperature=0, max_tokens=10), SpecParams(k=2)),
        (prompts[2], SamplingParams(temperature=0.7, max_tokens=40, seed=99), SpecParams(k=5)),
        (prompts[5], SamplingParams(temperature=1.0, top_k=5, max_tokens=16), SpecParams(k=1)),
    ]
    for at in (0, 2, 4):  # first, in the middle, last of the batch
        batch = list(others)
        batch.insert(at, (prompt, mine, SpecParams(k=3)))
        seqs = engine().generate(
            [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch]
        )
        s = seqs[at]
        assert s.output_ids == alone.output_ids, at
        assert (s.drafted, s.accepted) == (alone.drafted, alone.accepted)
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1235)
    again = engine().generate([prompt], other_seed, SpecParams(k=3))[0]
    assert again.output_ids != alone.output_ids


# -- requests with speculation off beside drafting ones -------------------------------------------
def test_plain_requests_cost_the_draft_model_nothing(models, prompts, plain_greedy):
    """A request with speculation off never drafts, so the draft model neither prefills its
    prompt nor holds a slot for it; both kinds of request, in one batch, still give the target's
    own greedy output."""
    e = engine_for(models, "model")
    draft = e.drafter.runner
    fed: list[list[int]] = []
    forward = draft.forward

    def counting(tokens, slots, *args, **kwargs):
        fed.append(list(slots))
        return forward(tokens, slots, *args, **kwargs)

    draft.forward = counting
    specs = [SpecParams(enabled=i % 2 == 0, k=3) for i in range(len(prompts))]
    seqs = [e.add_request(f"r{i}", p, GREEDY, sp) for i, (p, sp) in enumerate(zip(prompts, specs))]
    held, plain_slots = [], set()
    while e.has_work():
        e.step()  # (a request takes its slot at its prefill)
        plain_slots |= {s.slot for s, sp in zip(seqs, specs) if not sp.enabled and s.slot >= 0}
        held.append(set(range(draft.cache.num_slots)) - set(draft.cache.free_slots()))
    assert [s.output_ids for s in seqs] == plain_greedy
    assert len(plain_slots) == 3 and fed
    assert not any(plain_slots & set(slots) for slots in fed)  # never fed a plain row
    assert not any(plain_slots & h for h in held)  # nor held a draft slot for one
    assert sum(s.drafted for s in seqs) > 0  # the others drafted


def test_new_prompts_prefill_the_draft_model_together(models, prompts, monkeypatch):
    """The draft model takes the prompts admitted in one step in one ragged forward (while their
    padded size fits ADD_TOKENS), and caches the same keys and values as one forward a prompt."""
    from engine.drafters import model as model_drafter

    def first_step(add_tokens: int):
        monkeypatch.setattr(model_drafter, "ADD_TOKENS", add_tokens)
        e = engine_for(models, "model")
        inner = e.drafter
        forward, add, fed, adding = inner.runner.forward, inner.add, [], [False]

        def counting(tokens, slots, *a, **kw):
            if adding[0]:  # the slots of each draft forward inside add()
                fed.append(list(slots))
            return forward(tokens, slots, *a, **kw)

        def adding_add(seqs, lazy=False):
            adding[0] = True
            try:
                add(seqs, lazy)
            finally:
                adding[0] = False

        inner.runner.forward, inner.add = counting, adding_add
        seqs = [e.add_request(f"r{i}", p, GREEDY, SpecParams(k=3)) for i, p in enumerate(prompts)]
        e.step()  # the first four prompts' prefill (max_prefill 4) and first round
        cache = inner.runner.cache
        added = [s for s in seqs if s.slot >= 0 and cache.lengths[s.slot]]
        kv = [t[s.slot, :, : len(s.prompt_ids)] for s in added for t in cache.k + cache.v]
        return fed, [len(s.prompt_ids) for s in added], kv

    default = model_drafter.ADD_TOKENS
    alone, lengths, kv_alone = first_step(1)
    together, lengths2, kv_together = first_step(default)
    assert lengths == lengths2 == [len(p) for p in prompts[:4]]
    assert len(alone) == 4 and len(together) == 1
    assert sorted(together[0]) == sorted(s for slots in alone for s in slots)
    for a, b in zip(kv_alone, kv_together, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    capped, _, _ = first_step(2 * 17)  # 3 and 9 tokens together; 17 alone; 30 alone
    assert [len(g) for g in capped] == [2, 1, 1]
