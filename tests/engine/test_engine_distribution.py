"""End to end through the engine (prefill, drafter, verify, accept, cache commit) on tiny random
models with an 8-token vocabulary: sampled output with speculation follows the target's exact
distribution, and the test that says so can fail.

The test is the suite's one distribution test (tests/distribution.py): every token of ``N``
seeded requests of ``MAX_TOKENS`` tokens (one request per draw, batched over many slots), node by
node of the output tree, against the exact conditionals of the target (transformers' forward,
then temperature / top-k / top-p), one chi-square at ``ALPHA``. ``MAX_TOKENS = 6``: after the
prefill's token a round drafts up to K = 4. Its power is shown, not assumed: the same test, same
seeds, must reject engines that are subtly wrong -- the verify at a temperature 10% off, a drafter
that samples from one q and reports another (T = 1 against 0.8), one acceptance uniform shared by
a whole round -- and grossly wrong (every draft accepted, the recovered token drawn from p
instead of norm(max(p - q, 0)), the verify at T = 1), with the draft model (q a distribution) and
the n-gram drafter (q one-hot). The other drafters (the target itself, its first layer, a bf16
copy), the adaptive controller, the compiled paths and EOS at T > 0 with a drafter that rejects
run the same test. Greedy is checked exactly. Every request is seeded (or the engine's own seed
source fixed): the runs are deterministic."""

import random
import secrets

import pytest
import torch

from engine.drafters import model as draft_model_module
from engine.drafters.eagle.drafter import RunnersUp
from engine.kcontrol.controller import AdaptiveK, FixedK
from engine.records.params import SamplingParams, SpecParams
from engine.round import speculator as speculator_module
from engine.round import tree as tree_module
from engine.round.rejection import rejection_sample
from tests.distribution import (
    assert_fits,
    assert_rejects,
    chi2_sf,
    chi_square_gof,
    exact_joint,
)
from tests.helpers import assert_speculated, engine_for, sharp_tiny, spy_deep_paths

pytestmark = pytest.mark.usefixtures("single_thread")

V = 8
N = 4000  # seeded requests per run (4,000 run in a few seconds here)
# where the test must see subtle errors, and for the right engines those are told apart from.
# Measured here: a verify at T 10% off moves the statistic by ~500 over its ~1,450 degrees of
# freedom at 16,000 draws (draft model and n-gram alike), ~9 standard deviations: rejected at
# ALPHA with power > 0.999 (at 4,000 draws it was ~2.3 sd: p 1e-4 and 0.01, missed)
N_POWER = 16000
MAX_TOKENS = 6  # round 1 drafts up to K = 4 (its cap: max_tokens - 1 after the prefill's token)
K = 4
SLOTS = 1024
# the engine of every run: a slot per request, every prompt prefilled in one step
SIZES = dict(slots=SLOTS, chunk=10**6, max_len=16, max_prefill=SLOTS)
# the n-gram drafter finds drafts here (3 7 ... repeats) and the target often agrees with them
PROMPT = [3, 7, 3, 3, 7]


def tiny(seed):
    return sharp_tiny(seed, V)


@pytest.fixture(scope="module")
def models():
    return tiny(1), tiny(2)


def joint_of(target):
    """The exact joint distribution of ``target``'s output, by enumeration (memoized per
    params): ``get(temperature, top_k, top_p)``."""
    memo = {}

    def get(temperature, top_k, top_p):
        key = (temperature, top_k, top_p)
        if key not in memo:
            memo[key] = exact_joint(target, PROMPT, MAX_TOKENS, temperature, top_k, top_p)
        return memo[key]

    return get


@pytest.fixture(scope="module")
def joint(models):
    return joint_of(models[0])


# -- deliberately wrong acceptance rules (rejection_sample's signature) --------------------------
def _sample(p, greedy, noise):
    """The engine's categorical sample (an exponential race), argmax for greedy rows (no noise:
    every row greedy, and ``p`` may be the logits)."""
    if noise is None:
        return p.argmax(-1)
    return torch.where(greedy, p.argmax(-1), (p / noise).argmax(-1))


def accept_all(target_probs, draft_tokens, num_draft, draft_probs, greedy, uniforms, noise):
    """Every drafted token is kept; the bonus token is sampled from the target."""
    rows = torch.arange(target_probs.shape[0])
    return num_draft.clone(), _sample(target_probs[rows, num_draft], greedy, noise)


def wrong_residual(target_probs, draft_tokens, num_draft, draft_probs, greedy, uniforms, noise):
    """The right acceptances, but the recovered token drawn from p, not norm(max(p - q, 0))."""
    num_acc, _ = rejection_sample(
        target_probs, draft_tokens, num_draft, draft_probs, greedy, uniforms, noise
    )
    rows = torch.arange(target_probs.shape[0])
    return num_acc, _sample(target_probs[rows, num_acc], greedy, noise)


def wrong_temperature(used, wrong):
    """The verify at temperature ``wrong``, not ``used``: p re-tempered, then the real rule."""

    def rule(target_probs, *rest):
        p = target_probs ** (used / wrong)
        return rejection_sample(p / p.sum(-1, keepdim=True), *rest)

    return rule


def shared_uniform(target_probs, draft_tokens, num_draft, draft_probs, greedy, uniforms, noise):
    """One acceptance uniform for the whole round (the first position's), not one a position."""
    one = uniforms[:, :1].expand_as(uniforms)
    return rejection_sample(target_probs, draft_tokens, num_draft, draft_probs, greedy, one, noise)


def misreported_q(engine, monkeypatch, used=0.8, sampled=1.0):
    """The draft model samples at temperature ``sampled`` but reports q at ``used`` (no top-k /
    top-p: q at ``used`` is q at ``sampled`` raised to sampled / used, renormalised)."""
    real = draft_model_module.logits_to_probs

    def at_sampled(logits, temperature, *rest):
        return real(logits, torch.full_like(temperature, sampled), *rest)

    monkeypatch.setattr(draft_model_module, "logits_to_probs", at_sampled)
    inner = engine.drafter  # the ModelDrafter (the engine guards it in its own GuardedDrafter)
    propose = inner.propose

    def reported(seqs, plan):
        prop = propose(seqs, plan)
        if prop.probs is not None:
            q = prop.probs ** (sampled / used)
            prop.probs = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
        return prop

    inner.propose = reported


# -- one run of the test -------------------------------------------------------------------------
def sample(models, drafter, temperature, top_k, top_p, n=N, accept=None, wrong=None, **kw):
    """``n`` seeded requests of PROMPT through a fresh engine at K; returns (engine, sequences).
    ``accept``: a wrong acceptance rule; ``wrong``: a function (engine) that breaks the engine."""
    engine = engine_for(models, drafter, **SIZES, accept=accept, **kw)
    if wrong is not None:
        wrong(engine)
    params = [
        SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_tokens=MAX_TOKENS,
            seed=i,
            ignore_eos=True,
        )
        for i in range(n)
    ]
    return engine, engine.generate([PROMPT] * n, params, SpecParams(k=K))


def outputs(seqs):
    return [s.output_ids for s in seqs]


def spy_closed_walk(monkeypatch) -> list[bool]:
    """Record, per call of the tree rule's closed form (tree.closed_walk), whether it ran with
    sampled rows (noise given); returns the list it appends to."""
    closed: list[bool] = []
    walk = tree_module.closed_walk

    def counted(*a, **kw):
        closed.append(kw.get("noise", a[7] if len(a) > 7 else None) is not None)
        return walk(*a, **kw)

    monkeypatch.setattr(tree_module, "closed_walk", counted)
    return closed


# -- the test itself -------------------------------------------------------------------------------
def test_chi_square_helper():
    """Textbook quantiles (95th and 99.9th percentiles), pooling, and impossible outcomes."""
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(29.588, 10) == pytest.approx(0.001, abs=1e-5)
    probs = {"a": 0.5, "b": 0.3, "c": 0.199, "d": 0.001}
    stat, p, df = chi_square_gof({"a": 50, "b": 30, "c": 20}, probs)
    assert stat == pytest.approx(0.0, abs=0.01) and df == 2 and p > 0.99  # "d" pooled into "c"
    assert chi_square_gof({"a": 50, "e": 1}, probs)[1] == 0.0


# -- the right engine passes -----------------------------------------------------------------
class SyntheticCost:
    """A made-up machine where each drafted token costs 10% of a round: K then moves with the
    requests' acceptance estimates (a cost model that reads no clock: deterministic)."""

    shape = None

    def observe(self, *args):
        pass

    def predict(self, batch, width, steps, catch_up=0, tree=False):
        return 1.0 + 0.1 * width

    def add_calibration(self, *args):
        pass

    def add_step_calibration(self, *args):
        pass


def test_the_pass_rule_on_exact_draws(models, joint):
    """Draws made directly from the exact joint pass; draws from the joint at T = 0.88 (what a
    verify 10% off would give from the first token on) are rejected: the rule's own power, with
    no engine in the way."""
    g = torch.Generator().manual_seed(0)

    def draws(j, n=N):
        cells = list(j)
        idx = torch.multinomial(torch.tensor([j[c] for c in cells]), n, True, generator=g)
        return [cells[i] for i in idx.tolist()]

    right = joint(0.8, 0, 1.0)
    assert_fits(draws(right), right, "exact draws")
    assert_rejects(draws(joint(0.88, 0, 1.0)), right, "T = 0.88 draws")


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter,temperature,top_k,top_p,n",
    [
        ("model", 1.0, 0, 1.0, N),
        ("model", 0.8, 0, 1.0, N_POWER),  # the wrong engines below are told apart from these
        ("model", 0.8, 5, 0.9, N),
        ("ngram", 1.0, 0, 1.0, N),
        ("ngram", 0.8, 0, 1.0, N_POWER),
        ("ngram", 0.8, 5, 1.0, N),
        ("suffix", 0.8, 0, 1.0, N),  # seeded rows: its own index only
    ],
)
def test_sampled_speculation_matches_target_distribution(
    models, joint, drafter, temperature, top_k, top_p, n
):
    engine, seqs = sample(models, drafter, temperature, top_k, top_p, n)
    # both accept and reject paths ran, many times, and K reached 4
    drafted, accepted = assert_speculated(seqs, min_drafted=n)
    assert 0.05 < accepted / drafted < 0.95
    assert_fits(outputs(seqs), joint(temperature, top_k, top_p), f"{drafter} T={temperature}")
    assert engine.target.cache.used_tokens() == 0 and engine.target.cache.num_free() == SLOTS


@pytest.mark.slow
@pytest.mark.parametrize("drafter,temperature", [("model", 1.0), ("ngram", 0.8), ("suffix", 0.8)])
def test_adaptive_k_matches_target_distribution(models, joint, monkeypatch, drafter, temperature):
    """Unseeded requests under the adaptive controller (seeded ones pin K): K varies from round
    to round. The engine's own random draws are made reproducible by fixing its seed source.
    Suffix: unseeded rows also draft from the other requests' outputs (the shared index)."""
    monkeypatch.setattr(secrets, "randbits", random.Random(17).getrandbits)
    engine = engine_for(
        models,
        drafter,
        **SIZES,
        controller=AdaptiveK(4, cost=SyntheticCost()),
    )
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True)
    ks = []
    seqs = engine.generate(
        [PROMPT] * N,
        params,
        SpecParams(),
        on_step=lambda outs: ks.extend(o.stats.k for o in outs if o.stats),
    )
    assert_speculated(seqs, min_drafted=N // 5)
    assert len(set(ks)) >= 3  # K really varied from round to round
    if drafter == "suffix":  # rows drafted from other requests' outputs
        assert engine.drafter.shared_drafts > N // 10
    assert_fits(outputs(seqs), joint(temperature, 0, 1.0), f"adaptive {drafter} T={temperature}")
    assert engine.target.cache.used_tokens() == 0 and engine.target.cache.num_free() == SLOTS


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter,extra",
    [("self", {}), ("layers", {"num_layers": 1}), ("self", {"draft_dtype": torch.bfloat16})],
    ids=["self", "layers", "bf16-self"],
)
def test_target_as_its_own_draft_matches_target_distribution(models, joint, drafter, extra):
    """The fp32 target drafting for itself (q = p up to rounding), with its first layer, or with
    a bf16 copy of itself, at T > 0 with top-p on."""
    engine, seqs = sample(models, drafter, 0.8, 0, 0.9, **extra)
    exact_self = drafter == "self" and not extra  # the draft's distribution is the target's
    drafted, accepted = assert_speculated(seqs, can_reject=not exact_self, min_drafted=N)
    if exact_self:
        assert accepted > 0.9 * drafted
    assert_fits(outputs(seqs), joint(0.8, 0, 0.9), f"{engine.drafter.name} {extra}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "cuda-graphs"])
def test_compiled_path_matches_target_distribution(models, joint, mode):
    """The fast forward path (engine/model/compiled.py: inductor, on CPU;
    engine/model/cuda_graphs.py: captured graphs, re-run on CPU, the path of both modes on CUDA) for
    the target's verifies and the draft model's steps, at T > 0 with top-k and top-p on: the same
    test."""
    from engine.model.compiled import CompileConfig

    # rows are slots (one batch bucket); the key length, padded to 16, is dynamic in the graph
    cfg = CompileConfig(enabled=True, mode=mode, batch_buckets=[256], q_buckets=[1, 8], kv_align=16)
    engine = engine_for(
        models, "model", slots=256, chunk=10**6, max_len=128, max_prefill=256, compile=cfg
    )
    engine.warm_up()
    assert all(r.fast is not None for r in engine.runners()), "the compile fell back to eager"
    before = [r.fast.calls for r in engine.runners()]
    params = [
        SamplingParams(
            temperature=0.8, top_k=5, top_p=0.9, max_tokens=MAX_TOKENS, seed=i, ignore_eos=True
        )
        for i in range(N)
    ]
    seqs = engine.generate([PROMPT] * N, params, SpecParams(k=K))
    ran = [r.fast.calls - b for r, b in zip(engine.runners(), before)]
    assert all(n > 0 for n in ran), f"the fast path did not serve the requests: {ran}"
    assert_speculated(seqs, min_drafted=N)
    assert_fits(outputs(seqs), joint(0.8, 5, 0.9), "compiled")


# a prompt of one full cached block (16 positions) and PROMPT after it
CACHED_PROMPT = [1, 2, 5, 4, 0, 6, 3, 2, 2, 7, 1, 5, 4, 4, 0, 6] + PROMPT


@pytest.mark.slow
def test_prefix_cache_hits_and_preemptions_match_target_distribution(models):
    """Every request's prompt starts with a block the prefix cache holds (restored, not
    computed), and a KV budget below what the requests hold preempts some mid-decode (recomputed
    from the cache, the next token sampled from the recompute's logits): the same test."""
    joint = exact_joint(models[0], CACHED_PROMPT, MAX_TOKENS, 0.8, 0, 0.9)
    held = len(CACHED_PROMPT) + MAX_TOKENS + 9  # what a sequence may hold: prompt, output, K+1
    engine = engine_for(
        models,
        "model",
        slots=SLOTS,
        chunk=10**6,
        max_len=32,
        max_prefill=SLOTS,
        prefix_cache=64,
        kv_budget=held * 300,  # about 300 of the 1,024 slots' worth
    )
    engine.generate([CACHED_PROMPT], SamplingParams(temperature=0, max_tokens=1))  # fills it
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, seed=i, ignore_eos=True)
        for i in range(N)
    ]
    seqs = engine.generate([CACHED_PROMPT] * N, params, SpecParams(k=K))
    assert all(s.cached_tokens == 16 for s in seqs if not s.preemptions)
    assert engine.load().preemptions > 0 and any(s.cached_tokens for s in seqs if s.preemptions)
    assert_speculated(seqs, min_drafted=N)
    assert_fits(outputs(seqs), joint, "prefix cache hits and preemptions")
    assert engine.target.cache.used_tokens() == 0 and engine.scheduler.room() == held * 300


EOS = 6  # emitted often after PROMPT: outputs end at lengths 1..6 or run to max_tokens


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "self", None])
def test_eos_at_temperature_ends_outputs_there_with_the_target_lengths(models, drafter):
    """EOS at T > 0: every output ends exactly at its first EOS, and outputs follow the target's
    exact distribution, with speculation and without (the plain engine also checks the
    enumeration). With the target drafting for itself EOS is drafted, accepted, and the accepted
    drafts after it are cut; with the draft model drafts are also rejected, EOS among them."""
    max_tokens = 6
    engine = engine_for(models, drafter, **SIZES, eos=[EOS])
    params = [
        SamplingParams(temperature=0.9, top_k=3, max_tokens=max_tokens, seed=i) for i in range(N)
    ]
    cut = []

    def on_step(outs):
        cut.extend(o for o in outs if o.stats and o.stats.emitted < o.stats.accepted + 1)

    seqs = engine.generate([PROMPT] * N, params, SpecParams(k=3), on_step=on_step)
    for s in seqs:
        out = s.output_ids
        assert EOS not in out[:-1]
        if out[-1] == EOS:
            assert s.finish_reason == "stop"
        else:
            assert s.finish_reason == "length" and len(out) == max_tokens
    if drafter is not None:
        assert_speculated(seqs, can_reject=drafter == "model")
    if drafter == "self":  # accepted drafts after an accepted EOS were cut
        assert cut and all(o.finished and o.finish_reason == "stop" for o in cut)
    exact = exact_joint(models[0], PROMPT, max_tokens, 0.9, 3, 1.0, stop=[EOS])
    assert_fits(outputs(seqs), exact, f"EOS, {drafter}")


# -- draft trees: the EAGLE-3 head's chain plus its runners-up as leaves (round/draft_tree.py) ----
LEAVES = 3  # leaves beside the chain of K = 4 (the verify's 8 nodes)


@pytest.fixture(scope="module")
def tree_target():
    """A 3-layer tiny target: an EAGLE-3 head taps three distinct layers."""
    return sharp_tiny(1, V, layers=3)


@pytest.fixture(scope="module")
def tree_joint(tree_target):
    return joint_of(tree_target)


def tree_head(target):
    """A random EAGLE-3 head for the tiny target, its draft vocabulary 6 of the 8 tokens (q is
    zero outside it: runners-up past q's support are none)."""
    from tests.eagle_builders import random_head

    t = target.config
    return random_head(5, vocab=V, draft_vocab=6, layers=t.num_hidden_layers, hidden=t.hidden_size)


def spied_trees(engine, monkeypatch, temperature, top_k, top_p, n):
    """``n`` copies of PROMPT sampled through ``engine`` at K (ignore_eos), checked to have
    speculated; returns the outputs, their tree rounds and leaf hits, and per round the accepted
    nodes below a runner-up or branch (spy_deep_paths) and the closed form's calls
    (spy_closed_walk)."""
    deep = spy_deep_paths(monkeypatch)
    closed = spy_closed_walk(monkeypatch)
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    seqs = engine.generate([PROMPT] * n, params, SpecParams(k=K))
    assert_speculated(seqs, min_drafted=n)
    trees, hits = sum(s.tree_rounds for s in seqs), sum(s.leaf_hits for s in seqs)
    return seqs, trees, hits, deep, closed


def sample_trees(target, monkeypatch, temperature, top_k, top_p, n=N, wrong=None, topk=0):
    """``n`` unseeded requests (a seeded row stays a chain: draft_tree.may_grow) with trees of
    ``LEAVES`` leaves at K; the engine's seed source fixed. ``wrong(monkeypatch)`` breaks it.
    ``topk``: the trees expand EAGLE-2's way (drafter.tree_topk), their candidates chosen."""
    monkeypatch.setattr(secrets, "randbits", random.Random(23).getrandbits)
    if wrong is not None:
        wrong(monkeypatch)
    engine = engine_for(
        target, "eagle3", **SIZES, head=tree_head(target), controller=FixedK(K, LEAVES),
        tree_topk=topk,
    )  # fmt: skip
    seqs, trees, hits, deep, closed = spied_trees(engine, monkeypatch, temperature, top_k, top_p, n)
    assert trees >= n and hits > n // 100, (trees, hits)  # trees ran; leaves were taken
    assert (sum(deep) > n // 100) == bool(topk), sum(deep)  # the expansion's nodes were taken
    if wrong is None:  # an expanded tree's sampled rows take the closed form; drawn ones never
        assert (sum(closed) > 0) == bool(topk and temperature > 0), sum(closed)
    return seqs


@pytest.mark.slow
@pytest.mark.parametrize("topk", [0, 3], ids=["leaves", "expanded"])
@pytest.mark.parametrize("temperature,top_k,top_p,n", [(1.0, 0, 1.0, N), (0.8, 5, 0.9, N)])
def test_draft_trees_match_target_distribution(
    tree_target, tree_joint, monkeypatch, temperature, top_k, top_p, n, topk
):
    seqs = sample_trees(tree_target, monkeypatch, temperature, top_k, top_p, n, topk=topk)
    assert_fits(outputs(seqs), tree_joint(temperature, top_k, top_p), f"trees T={temperature}")


def siblings_against_q(monkeypatch):
    """The tree rule trying each sibling against q itself, not q with the rejected candidates
    taken out (over-accepts the second candidate)."""
    monkeypatch.setattr(tree_module, "without", lambda q, x: q)


def runners_up_by_rank(monkeypatch):
    """The leaves are q's top candidates after the draft, not the race's next arrivals (not a
    sample of q without replacement)."""
    take = RunnersUp.take

    def by_rank(self, keys, q, row_t, j, greedy, ids=None):
        pick = take(self, keys, q, row_t, j, greedy, ids)
        first = keys.argmax(-1)  # the draft, in q's own indexing
        after = q.scatter(-1, first[:, None], -1.0).topk(self.width, dim=-1).indices
        self.tokens[row_t, j] = after if ids is None else ids[after]
        return pick

    monkeypatch.setattr(RunnersUp, "take", by_rank)


def chosen_tried_as_drawn(monkeypatch):
    """An expanded tree's candidates (chosen, not drawn) tried by the rule for drawn ones, not
    each as a point mass: the chain's one-hot q still tries its node right, but a sibling meets
    the q left without it (nothing) and is taken whenever the target allows it."""
    accept = speculator_module.tree_accept
    monkeypatch.setattr(
        speculator_module,
        "tree_accept",
        lambda *a, **kw: accept(*a, depth=kw["depth"], width=kw["width"]),  # no point rows
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "wrong,topk",
    [(siblings_against_q, 0), (runners_up_by_rank, 0), (chosen_tried_as_drawn, 3)],
)
def test_the_test_rejects_wrong_tree_rules(tree_target, tree_joint, monkeypatch, wrong, topk):
    seqs = sample_trees(tree_target, monkeypatch, 1.0, 0, 1.0, N_POWER, wrong=wrong, topk=topk)
    assert_rejects(outputs(seqs), tree_joint(1.0, 0, 1.0), wrong.__name__)


# -- suffix trees: the copied draft plus the match's other continuations (drafters/suffix.py) ----
def sample_suffix_trees(models, monkeypatch, temperature, top_k, top_p, n=N, wrong=None):
    """``n`` unseeded requests (a seeded row stays a chain on its own index) through the suffix
    drafter at K with ``LEAVES`` leaves: the branches come mostly from the other requests'
    outputs (the shared index), every node chosen, tried as a point mass, so the rule runs in
    closed form with sampled rows. The engine's seed source fixed; ``wrong(monkeypatch)``
    breaks it."""
    monkeypatch.setattr(secrets, "randbits", random.Random(29).getrandbits)
    if wrong is not None:
        wrong(monkeypatch)
    engine = engine_for(models, "suffix", **SIZES, controller=FixedK(K, LEAVES))
    seqs, trees, hits, deep, closed = spied_trees(engine, monkeypatch, temperature, top_k, top_p, n)
    assert trees >= n // 2 and hits > n // 100, (trees, hits)  # trees ran; branches were taken
    assert sum(deep) > 0, sum(deep)  # ... and nodes below a branch
    assert engine.drafter.shared_drafts > n // 10
    if wrong is None:
        assert sum(closed) > 0
    return seqs


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_suffix_trees_match_target_distribution(
    models, joint, monkeypatch, temperature, top_k, top_p
):
    seqs = sample_suffix_trees(models, monkeypatch, temperature, top_k, top_p)
    assert_fits(outputs(seqs), joint(temperature, top_k, top_p), f"suffix trees T={temperature}")


@pytest.mark.slow
def test_the_test_rejects_suffix_branches_tried_as_drawn(models, joint, monkeypatch):
    """The suffix drafter's nodes tried without the point-mass rule (no q reported, none marked
    chosen): the rule then takes a node where it is the target's argmax, sampled rows too."""
    seqs = sample_suffix_trees(models, monkeypatch, 1.0, 0, 1.0, N_POWER, chosen_tried_as_drawn)
    assert_rejects(outputs(seqs), joint(1.0, 0, 1.0), "suffix branches tried as drawn")


# -- ... and the same test rejects wrong engines ------------------------------------------------
# name: (rule, the drafter it runs with, draws the test gets to see it). Each rule runs with one
# drafter (the CI's time): the n-gram's one-hot q and the draft model's soft q take turns.
WRONG_RULES = {
    "verify at T 10% off (0.88 for 0.8)": (wrong_temperature(0.8, 0.88), "ngram", N_POWER),
    "one uniform shared by the round": (shared_uniform, "model", N_POWER),
    "accept every draft": (accept_all, "model", N),
    "recovered from p, not the residual": (wrong_residual, "ngram", N),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", list(WRONG_RULES))
def test_the_test_rejects_a_wrong_engine(models, joint, wrong):
    rule, drafter, n = WRONG_RULES[wrong]
    _, seqs = sample(models, drafter, 0.8, 0, 1.0, n, accept=rule)
    assert_speculated(seqs, can_reject=False, min_drafted=n)
    assert_rejects(outputs(seqs), joint(0.8, 0, 1.0), f"{drafter}, {wrong}")


@pytest.mark.slow
def test_the_test_rejects_a_drafter_that_misreports_q(models, joint, monkeypatch):
    def wrong(engine):
        misreported_q(engine, monkeypatch)

    _, seqs = sample(models, "model", 0.8, 0, 1.0, N_POWER, wrong=wrong)
    assert_speculated(seqs, min_drafted=N_POWER)
    assert_rejects(outputs(seqs), joint(0.8, 0, 1.0), "draws at T = 1, q reported at 0.8")


# -- greedy: exact ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (int(n),), generator=g).tolist() for n in range(2, 34)]


GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def greedy_plain(models, greedy_prompts):
    plain = engine_for(models, None, slots=64, max_len=64)
    return [s.output_ids for s in plain.generate(greedy_prompts, GREEDY)]


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_speculation_is_exact_and_the_check_sees_accept_all(
    models, greedy_prompts, greedy_plain, drafter
):
    e = engine_for(models, drafter, slots=64, max_len=64)
    seqs = e.generate(greedy_prompts, GREEDY, SpecParams(k=K))
    assert [s.output_ids for s in seqs] == greedy_plain
    assert_speculated(seqs)
    wrong = engine_for(models, drafter, slots=64, max_len=64, accept=accept_all)
    seqs = wrong.generate(greedy_prompts, GREEDY, SpecParams(k=K))
    assert [s.output_ids for s in seqs] != greedy_plain
