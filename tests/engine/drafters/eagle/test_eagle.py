"""The EAGLE-3 drafter (engine/drafters/eagle/drafter.py) over tiny random models: greedy output
equals plain greedy output (batch 1 and ragged batches), the head's cache after every round equals a
fresh ingest of the same features, in the all-accepted and first-rejected cases, and sampled
output follows the target's distribution (chi-square at a fixed significance)."""

from __future__ import annotations

import pytest
import torch

from engine.builder import head_runner
from engine.drafters.eagle.drafter import WINDOW, EagleDrafter
from engine.kcontrol.controller import FixedK
from engine.model.runner import ModelRunner
from engine.records.params import SamplingParams, SpecParams
from tests import helpers
from tests.distribution import assert_fits, assert_rejects, exact_joint
from tests.eagle_builders import (
    HIDDEN,
    LAYERS,
    VOCAB,
    draws,
    eagle_engine,
    echo_head,
    prompts,
    random_head,
)


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_equals_plain_batch_one(target, k):
    plain = helpers.engine_for(target, None, slots=4)
    eagle = eagle_engine(target, echo_head(target), k=k)
    g = SamplingParams(temperature=0, max_tokens=40)
    for p in prompts(4, seed=k):
        ref = plain.generate([p], g)[0].output_ids
        out = eagle.generate([p], g, SpecParams(k=k))[0]
        assert out.output_ids == ref
        assert out.drafted > 0


def test_greedy_equals_plain_ragged_batch(target):
    """Ragged rows (prompt lengths 3..40, max_tokens 5..60), more requests than slots, so rows
    join and leave the batch while others run."""
    ps = prompts(10, seed=7)
    plain = helpers.engine_for(target, None, slots=4)
    eagle = eagle_engine(target, echo_head(target), k=4)
    params = [SamplingParams(temperature=0, max_tokens=5 + 6 * i) for i in range(len(ps))]
    ref = [s.output_ids for s in plain.generate(ps, params)]
    out = eagle.generate(ps, params, SpecParams(k=4))
    assert [s.output_ids for s in out] == ref
    assert sum(s.accepted for s in out) > 0  # some drafts were right, some wrong
    assert sum(s.accepted for s in out) < sum(s.drafted for s in out)


def test_choices_sharing_a_prefill_draft_as_if_prefilled_alone(target):
    """n choices of one prompt prefill once; each follower's head takes a copy of the lead's
    prompt features (drafter fork) and drafts as a separate prefill would have it draft."""
    p = prompts(4, seed=7)[1]
    g = SamplingParams(temperature=0, max_tokens=30)
    alone = eagle_engine(target, echo_head(target), k=3).generate([p], g, SpecParams(k=3))[0]
    shared = eagle_engine(target, echo_head(target), k=3)
    seqs = [shared.add_request(f"c{i}", p, g, SpecParams(k=3), group="g") for i in range(3)]
    while shared.has_work():
        shared.step()
    assert [s.output_ids for s in seqs] == [alone.output_ids] * 3
    assert [(s.drafted, s.accepted) for s in seqs] == [(alone.drafted, alone.accepted)] * 3
    assert alone.accepted > 0 and shared.drafter.cache.used_tokens() == 0


def test_drafts_line_up_with_the_target():
    """With the target's last layer muted, the echo head's guess is exactly the target's current
    token, so while the output repeats one token every draft is accepted: a head fed features
    one position off (or tokens paired wrongly) would not be."""
    t = helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)
    with torch.no_grad():
        t.model.layers[-1].self_attn.o_proj.weight.zero_()
        t.model.layers[-1].mlp.down_proj.weight.zero_()
    eagle = eagle_engine(t, echo_head(t, draft_vocab=VOCAB), k=4)
    g = SamplingParams(temperature=0, max_tokens=30)
    for p in prompts(6, seed=7):
        ref = helpers.engine_for(t, None, slots=1).generate([p], g)[0].output_ids
        out = eagle.generate([p], g, SpecParams(k=4))[0]
        assert out.output_ids == ref
        if len(set(ref)) == 1:  # a repeat from the first token: every draft right
            assert out.accepted == out.drafted > 0
    assert eagle.drafter_failures == 0


def fresh_cache(drafter: EagleDrafter, target, seq, skip: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The head's K of positions [0, N - 1) computed from scratch: the target's features of the
    whole sequence (one prefill), taken in by a new drafter in one forward. ``skip`` (at, n):
    the n positions from ``at`` left out, the head's positions consecutive across the gap."""
    ids = seq.token_array().tolist()
    runner = ModelRunner(target, num_slots=1, max_len=256, taps=drafter.taps)
    runner.cache.allocate(0)
    feats = runner.forward([ids[:-1]], [0]).tapped[0]  # [N - 1, 3 hidden]
    at, n = skip
    feats = torch.cat([feats[:at], feats[at + n :]])  # position p pairs with token p + 1:
    ids = ids[: at + 1] + ids[at + n + 1 :]  # the tokens after the kept positions, in order
    own = head_runner(drafter.head, target.model.embed_tokens, 1, 256)
    fresh = EagleDrafter(drafter.head, own, drafter.vocab_size)
    fresh.cache.allocate(0)
    fresh.pending[0], fresh.pending_n[0], fresh.real[0] = [feats], len(feats), 0
    fresh.skipped[0] = 0

    class Row:  # the slot and tokens _ingest reads
        slot = 0

        def token_array(self):
            return torch.tensor(ids)

    fresh._ingest([Row()], [len(feats)])  # type: ignore[list-item]
    return fresh.cache.k[0][0, :, : len(feats)]


@pytest.mark.parametrize("case", ["all_accepted", "first_rejected", "mixed", "plain_rounds"])
def test_head_cache_equals_a_fresh_take_in(target, case):
    """After every round the head's real positions equal a fresh ingest of the target's
    features of the whole sequence, and pending + real covers exactly N - 1 positions; rounds
    at K = 0 (``plain_rounds``) keep at most 2 WINDOW positions pending (older ones skipped)."""
    head = random_head(6)
    rule = None
    k = 0 if case == "plain_rounds" else 3
    if case in ("all_accepted", "first_rejected"):  # force it: all accepted, or the first rejected
        n_acc = 3 if case == "all_accepted" else 0

        def rule(probs, drafts, num, q, greedy, u, noise):
            acc = torch.clamp(num, max=n_acc)
            nxt = probs[torch.arange(len(num)), acc].argmax(-1)
            return acc, nxt

    engine = eagle_engine(target, head, k=3, accept=rule)
    d = engine.drafter
    assert isinstance(d, EagleDrafter)
    seqs = [
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=30), SpecParams(k=k))
        for i, p in enumerate(prompts(3, seed=11))
    ]
    checked = 0
    while engine.has_work():
        engine.step()
        for s in seqs:
            if s.slot < 0 or s.slot not in d.real or s.num_tokens < 2:
                continue
            real, skipped = d.real[s.slot], d.skipped[s.slot]
            assert skipped + real + d.pending_n[s.slot] == s.num_tokens - 1
            assert d.pending_n[s.slot] <= 2 * WINDOW and (skipped == 0 or case == "plain_rounds")
            ours = d.cache.k[0][s.slot, :, :real]
            ref = fresh_cache(d, target, s)[:, :real]
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked > 10


class PlainThenK(FixedK):
    """K = 0 for the first ``plain`` rounds, then K: a stretch at K = 0 past 2 WINDOW. It
    expects drafts from the start (``eager``) or only once they come."""

    def __init__(self, plain: int, k: int, eager: bool):
        super().__init__(k)
        self.plain, self.eager = plain, eager
        self.catch_ups: list[int] = []  # end_round's catch_up, per round

    def k_for(self, seq, cap):
        return 0 if self.plain > 0 else super().k_for(seq, cap)

    def expects_drafts(self):
        return self.eager or self.plain <= 0

    def end_round(self, batch, width, steps, rest_s, draft_s, catch_up=0, extra_rows=0, tree=False):
        self.plain -= 1
        self.catch_ups.append(catch_up)


@pytest.mark.parametrize("eager", [True, False])
def test_a_long_stretch_at_k0_is_skipped_and_output_stays_exact(target, eager):
    """Rows at K = 0 for more than 2 WINDOW rounds take nothing in: all but the last WINDOW
    positions are skipped (the prompt's too when no draft was expected at admission: ``lazy``).
    Drafting again, the head takes in the rest right after its real positions (its cache then
    equals a fresh ingest of the sequence without the skipped stretch), and greedy output
    equals plain decoding's."""
    head, g = random_head(7), SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    ps = prompts(3, seed=5)
    refs = [helpers.engine_for(target, None, slots=4).generate([p], g)[0].output_ids for p in ps]
    engine = helpers.engine_for(target, "eagle3", 4, max_len=256, head=head)
    engine.speculator.controller = ctl = PlainThenK(2 * WINDOW + 12, 3, eager)
    d = engine.drafter
    assert isinstance(d, EagleDrafter)
    ingested: list[int] = []
    ingest = d._ingest
    d._ingest = lambda seqs, counts: ingested.append(sum(counts)) or ingest(seqs, counts)
    seqs = [engine.add_request(str(i), p, g, SpecParams()) for i, p in enumerate(ps)]
    engine.step()  # the prompts (their features taken in by add unless lazy), the first round
    added = len(ingested)
    assert added == (1 if eager else 0)
    for _ in range(2 * WINDOW + 10):  # plain rounds: nothing taken in, the oldest skipped
        engine.step()
    assert len(ingested) == added
    assert all(d.skipped[s.slot] > 0 and d.pending_n[s.slot] <= 2 * WINDOW for s in seqs)
    # the backlog the K controller prices: what the first draft takes in beyond one a row
    assert all(s.kstate.backlog == d.pending_n[s.slot] - 1 > 0 for s in seqs)
    while len(ingested) == added:  # up to the first drafting round
        backlog = sum(s.kstate.backlog for s in seqs)
        engine.step()
    assert ingested[added] == backlog + len(seqs) and ctl.catch_ups[-1] == backlog
    while engine.has_work():
        engine.step()
        for s in (s for s in seqs if s.slot >= 0 and s.slot in d.real):
            real, skipped = d.real[s.slot], d.skipped[s.slot]
            assert skipped + real + d.pending_n[s.slot] == s.num_tokens - 1
            at = len(s.prompt_ids) - 1 if eager else 0  # where the skipped stretch starts
            ref = fresh_cache(d, target, s, (at, skipped))[:, :real]
            torch.testing.assert_close(d.cache.k[0][s.slot, :, :real], ref, atol=1e-4, rtol=1e-4)
    assert [s.output_ids for s in seqs] == refs
    assert sum(s.drafted for s in seqs) > 0 and engine.drafter_failures == 0


@pytest.mark.usefixtures("single_thread")
def test_sampled_distribution_matches_target():
    """4,000 seeded requests of 6 tokens at T = 0.8 with top-k and top-p, the head drafting K = 4
    with its own q over an 8-of-12-token draft vocabulary (zero outside it): the suite's
    distribution test (tests/distribution.py). The same test rejects a drafter that reports a q
    other than the one it sampled from (uniform over its vocabulary)."""
    small = helpers.sharp_tiny(1, vocab=12, layers=LAYERS)
    prompt, sampling = [3, 7, 3, 3, 7], dict(temperature=0.8, top_k=6, top_p=0.95)
    exact = exact_joint(small, prompt, 6, **sampling)
    head = random_head(9, vocab=12, draft_vocab=8, hidden=32)
    assert_fits(
        draws(eagle_engine(small, head, slots=1024, k=4), prompt, **sampling), exact, "eagle3"
    )

    wrong = eagle_engine(small, head, slots=1024, k=4)
    d = wrong.drafter
    propose = d.propose

    def misreported(seqs, plan):
        prop = propose(seqs, plan)
        inside = prop.probs > 0
        prop.probs = inside / inside.sum(-1, keepdim=True).clamp(min=1)
        return prop

    d.propose = misreported
    assert_rejects(draws(wrong, prompt, **sampling), exact, "eagle3, q reported uniform")


@pytest.mark.parametrize("topk", [0, 3], ids=["leaves", "expanded"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_draft_trees_greedy_equal_plain_beside_chains(target, compiled, topk, monkeypatch):
    """Draft trees (the chain of K = 3 plus 4 nodes: runners-up as leaves, or EAGLE-2's
    expansion with top 3: round/draft_tree.py, eagle/expand.py) in ragged batches beside chains
    (a row with a logit bias stays a chain: draft_tree.may_grow), eager and on the compiled path
    (its graphs replayed with the tree mask; the head's chained steps compiled): greedy output
    is plain decoding's, and paths ended at leaves (expanded: below runners-up too)."""
    from engine.kcontrol.controller import FixedK
    from engine.model.compiled import CompileConfig

    cfg = None
    if compiled:
        cfg = CompileConfig(enabled=True, batch_buckets=[4], q_buckets=[1, 8], kv_align=16)
    ps = prompts(8, seed=11)
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 5 * i, logit_bias=((1, 0.0),) if i % 3 else ())
        for i in range(len(ps))
    ]
    plain = helpers.engine_for(target, None, slots=4)
    ref = [s.output_ids for s in plain.generate(ps, params)]
    eagle = helpers.engine_for(
        target, "eagle3", 4, head=echo_head(target), controller=FixedK(3, 4), compile=cfg,
        tree_topk=topk,
    )  # fmt: skip
    deep = helpers.spy_deep_paths(monkeypatch)
    if compiled:
        eagle.warm_up()
        before, head_before = eagle.target.fast.calls, eagle.drafter.head_runner.fast.calls
    out = eagle.generate(ps, params, SpecParams(k=3))
    assert [s.output_ids for s in out] == ref
    helpers.assert_speculated(out)
    trees = [s.tree_rounds for s in out]
    assert all(t > 0 for t, p in zip(trees, params) if not p.logit_bias)
    assert all(t == 0 for t, p in zip(trees, params) if p.logit_bias)  # chains beside them
    assert sum(s.leaf_hits for s in out) > 0
    assert (sum(deep) > 0) == bool(topk), sum(deep)
    if compiled:
        assert eagle.target.fast.calls > before and eagle.target.fast is not None
        head_fast = eagle.drafter.head_runner.fast  # its ingests and chained steps compiled
        assert head_fast is not None and head_fast.calls > head_before


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_expansion_nodes_are_what_the_head_drafts_along_their_path(target, sampled):
    """EAGLE-2's expansion (drafter.tree_topk: expand.py) feeds the head a tree's extra nodes in
    the chain's calls, each under a mask of its own ancestors at its own cache column. Every node
    it makes (the chain's runners-up and the extras' children, with parents) is worth the
    product of the head's q along its path, as the head drafting that path as a chain computes
    it afresh; a sampled row drafts deterministically too (its chain is each depth's top q) and
    reports q one-hot. A random head (its attention live, unlike the echo head's), batch of 2."""
    from engine.kcontrol.controller import FixedK

    head = random_head(5, vocab=VOCAB, draft_vocab=12)
    eng = helpers.engine_for(target, "eagle3", 4, head=head, controller=FixedK(3, 5), tree_topk=3)
    d = eng.drafter
    seen = {}
    ingest, propose = d._ingest, d.propose

    def spy_ingest(seqs, counts):
        out, logits = ingest(seqs, counts)
        seen["root"] = (out.clone(), logits.clone(), [d.real[s.slot] for s in seqs])
        seen["slots"] = [s.slot for s in seqs]
        return out, logits

    def spy_propose(seqs, plan):
        prop = propose(seqs, plan)
        seen.setdefault("props", []).append((prop, seen["root"], seen["slots"]))
        return prop

    d._ingest, d.propose = spy_ingest, spy_propose
    t = 1.0 if sampled else 0.0
    ps = prompts(2, seed=4)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=t, max_tokens=12), SpecParams(k=3))
    checked = 0
    while eng.has_work() and checked < 40:
        n_props = len(seen.get("props", []))
        eng.step()
        if len(seen.get("props", [])) == n_props:
            continue
        prop, (out_root, logits_root, reals), slots = seen["props"][-1]
        alts = prop.alternatives
        assert alts is not None and alts.more is not None and bool(alts.point.all())
        kk, s_ = alts.tokens.shape[1:]
        toks = torch.cat([prop.tokens, alts.tokens.flatten(1), alts.more[0]], 1)
        vals = torch.cat([alts.values.flatten(1), alts.more[1]], 1)
        run_par = (torch.arange(kk) - 1).repeat_interleave(s_)
        pars = torch.cat([torch.arange(-1, kk - 1).expand(len(slots), -1),
                          run_par.expand(len(slots), -1), alts.more[2]], 1)  # fmt: skip
        for b, (slot, real) in enumerate(zip(slots, reals)):
            if prop.probs is not None:  # deterministic drafts: q one-hot
                hot = prop.probs[b, : prop.num[b]]
                assert torch.equal(hot.argmax(-1), prop.tokens[b, : prop.num[b]])
                assert bool((hot.max(-1).values == 1).all())
            for m in (vals[b] > float("-inf")).nonzero()[:, 0].tolist():
                path, node = [], kk + m
                while node >= 0:
                    path.append(int(toks[b, node]))
                    node = int(pars[b, node])
                path.reverse()
                out, logits, q_path = out_root[b : b + 1], logits_root[b : b + 1], 1.0
                for depth, tok in enumerate(path):
                    q = torch.softmax(logits.float(), -1)[0]
                    q_path *= float(q[(d.draft_ids == tok).nonzero()[0, 0]])
                    if depth + 1 < len(path):
                        tok_t = torch.tensor([tok])
                        assert d.cache.lengths[slot] == real + depth
                        out, logits = d.chain_step(tok_t, out, [slot])
                        d.cache.commit(slot, real + depth + 1)
                d.cache.rollback(slot, real)
                assert abs(float(vals[b, m]) - q_path) <= 1e-4 + 1e-3 * q_path, (path, b, m)
                checked += 1
    assert checked >= 40
    assert eng.drafter_failures == 0
