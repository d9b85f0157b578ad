"""Lossless on the real SmolLM2-135M (fp32): speculative greedy output is token-for-token the
target-only greedy output (transformers' own generate() as the independent reference), for each
drafter, alone and batched; the KV caches after every round equal a fresh prefill; seeded
sampling reproduces."""

import pytest
import torch

from engine.kcontrol.controller import FixedK
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import Status
from prompts.sets import encode, human_eval, mt_bench
from tests import helpers

pytestmark = pytest.mark.real_model
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(real_fp32):
    _, tok = real_fp32
    mt = {p.category: p for p in mt_bench()}  # one per category, last of each
    chosen = [mt[c] for c in ("coding", "extraction", "writing", "reasoning")] + human_eval()[:4]
    return [encode(tok, p) for p in chosen]


@pytest.fixture(scope="module")
def reference(real_fp32, prompts):
    model, tok = real_fp32
    return [helpers.greedy_reference(model, tok, ids, MAX_TOKENS) for ids in prompts]


HEAD = "models/smollm2-135m-eagle3"  # the EAGLE-3 head this project trains and ships


@pytest.fixture(scope="module")
def head(real_fp32):
    """The shipped EAGLE-3 head, in fp32 like the target of these tests."""
    from engine.builder import head_folder
    from engine.drafters.eagle.head import load_head

    return load_head(head_folder(HEAD), len(real_fp32[0].model.layers))


def real_engine(real_fp32, method, num_layers=None, dtype=None, head=None, slots=8):
    """An engine over the real model (fp32 target), 8 slots (tests/helpers.py)."""
    return helpers.engine_for(
        real_fp32[0],
        method,
        slots=slots,
        max_len=1024,
        num_layers=num_layers,
        draft_dtype=getattr(torch, dtype) if dtype else None,
        head=head,
    )


def assert_same(seqs, reference):
    for i, (s, ref) in enumerate(zip(seqs, reference)):
        assert s.output_ids == ref, f"prompt {i}: speculative output differs from plain greedy"


def run_each(engine, prompts, k, on_step=None):
    return [engine.generate([p], GREEDY, SpecParams(k=k), on_step=on_step)[0] for p in prompts]


def test_plain_engine_equals_transformers_generate(real_fp32, prompts, reference):
    """Half the prompts (the CI's time): every test below compares with the same reference."""
    assert_same(run_each(real_engine(real_fp32, "none"), prompts[1::2], 0), reference[1::2])


def test_ngram_drafter_is_lossless(real_fp32, prompts, reference):
    seqs = run_each(real_engine(real_fp32, "ngram"), prompts, k=5)
    assert_same(seqs, reference)
    helpers.assert_speculated(seqs)


def test_suffix_drafter_is_lossless(real_fp32, prompts, reference):
    """One engine, the prompts one after another: each later request may draft from the
    earlier ones' outputs (the shared index) as well as from its own text."""
    engine = real_engine(real_fp32, "suffix")
    seqs = run_each(engine, prompts, k=5)
    assert_same(seqs, reference)
    helpers.assert_speculated(seqs)
    assert engine.drafter.own_drafts > 0 and engine.drafter.rows == {}


def test_suffix_trees_are_lossless(real_fp32, prompts, reference):
    """The same with draft trees: K = 5 and 3 leaves, the match's other continuations verified
    beside each draft (drafters/suffix.py); some rounds verified trees and took a branch."""
    engine = helpers.engine_for(
        real_fp32[0], "suffix", slots=8, max_len=1024, controller=FixedK(5, 3)
    )
    seqs = run_each(engine, prompts, k=5)
    assert_same(seqs, reference)
    helpers.assert_speculated(seqs)
    trees, hits = sum(s.tree_rounds for s in seqs), sum(s.leaf_hits for s in seqs)
    assert trees > 0 and hits > 0, (trees, hits)


def test_suffix_drafts_a_repeated_answer_from_the_earlier_request(real_fp32, prompts, reference):
    """A then B, the same prompt (which does not hold A's answer): B's greedy answer is A's, so
    B drafts it from A's output in the shared index and takes fewer target passes than A; with
    the shared index off, B takes as many as A. Both exact."""
    runs = {}
    for shared in (True, False):
        engine = real_engine(real_fp32, "suffix")
        if not shared:
            engine.drafter.shared = None
        a, b = run_each(engine, [prompts[4], prompts[4]], k=7)
        assert_same([a, b], [reference[4]] * 2)
        runs[shared] = (a, b, engine.drafter.shared_drafts)
    a, b, shared_rows = runs[True]
    helpers.assert_speculated([b], can_reject=False)
    assert shared_rows > 0 and b.target_passes < a.target_passes
    a0, b0, shared0 = runs[False]
    assert shared0 == 0 and b0.target_passes == a0.target_passes == a.target_passes


def test_eagle_head_is_lossless_and_accepts(real_fp32, prompts, reference, head):
    """The shipped head, batch 1 at K = 4 (half the prompts: the CI's time), then all prompts
    as one ragged batch at K = 3."""
    seqs = run_each(real_engine(real_fp32, "eagle3", head=head), prompts[::2], k=4)
    assert_same(seqs, reference[::2])
    drafted, accepted = helpers.assert_speculated(seqs)
    # a trained head: drafts right well beyond chance (an untrained one: ~1 in 8192), not all
    assert 0.04 * drafted < accepted
    engine = real_engine(real_fp32, "eagle3", head=head)
    seqs = engine.generate(prompts, GREEDY, SpecParams(k=3))
    assert_same(seqs, reference)
    helpers.assert_speculated(seqs)
    assert engine.drafter_failures == 0
    assert engine.target.cache.used_tokens() == 0 and engine.drafter.cache.used_tokens() == 0


def test_eagle_head_under_adaptive_k_is_lossless(real_fp32, prompts, reference, head):
    """The default controller (measured costs of this machine, the head's draft step priced
    live), batched: exact whatever K it picks. Eight requests of 11..32 tokens in 4 slots, so
    rows join and leave the batch (the head's cache slots reused) while others run."""
    engine = real_engine(real_fp32, "eagle3", head=head, slots=4)
    lengths = [MAX_TOKENS - 3 * i for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in lengths]
    seqs = engine.generate(prompts, params, SpecParams())
    assert_same(seqs, [ref[:n] for ref, n in zip(reference, lengths)])
    assert engine.controller.calibrated and engine.drafter_failures == 0
    helpers.assert_speculated(seqs, can_reject=False)
    assert engine.target.cache.used_tokens() == 0 and engine.drafter.cache.used_tokens() == 0


@pytest.mark.parametrize("topk", [0, 4], ids=["leaves", "expanded"])
def test_eagle_trees_are_lossless_and_both_caches_follow_the_path(
    real_fp32, prompts, reference, head, monkeypatch, topk
):
    """Draft trees (the head's chain of K = 3 plus 4 of its runners-up as leaves, or a chain of
    2 plus 6 nodes of EAGLE-2's expansion with top 4) in a ragged batch with chains beside them
    (seeded rows stay chains: draft_tree.may_grow): greedy output is the reference's; after
    every round the target's cache equals a fresh prefill and the head's pending features are
    the target's fresh features of the same positions, after paths that ended off the chain
    deep in the tree and at the root's, and (expanded) paths through a node below a
    runner-up."""
    from engine.kcontrol.controller import FixedK

    engine = helpers.engine_for(
        real_fp32[0], "eagle3", slots=8, max_len=1024, head=head,
        controller=FixedK(3, 4) if not topk else FixedK(2, 6), tree_topk=topk,
    )  # fmt: skip
    deep = helpers.spy_deep_paths(monkeypatch)
    target, eagle = engine.target, engine.drafter
    spare = 7  # a slot no request takes (4 requests), for the fresh forwards
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, seed=7 if i == 2 else None)
        for i in range(4)
    ]
    seqs = [
        engine.add_request(f"r{i}", p, g, SpecParams(k=3))
        for i, (p, g) in enumerate(zip(prompts[4:], params))  # the shorter (HumanEval)
    ]
    hits, checked = set(), 0
    while engine.has_work():
        for out in engine.step():
            if out.stats is not None and out.stats.leaf_hit:
                hits.add("deep" if out.stats.accepted > 1 else "root")
        for s in seqs[1:3]:  # a tree and the chain beside it (the fresh forwards' time)
            if s.status is not Status.RUNNING or not s.output_ids:  # (or still prefilling)
                continue
            toks = s.tokens
            assert target.cache.lengths[s.slot] == len(toks) - 1
            got = target.forward([toks[-1:]], [s.slot]).logits[0]
            target.cache.allocate(spare)
            fresh = target.forward([toks], [spare])
            target.cache.free(spare)
            torch.testing.assert_close(got, fresh.logits[0], atol=2e-4, rtol=1e-4)
            # the head's pending features: positions [skipped + real, len - 1) of the sequence
            first = eagle.skipped[s.slot] + eagle.real[s.slot]
            if eagle.pending_n[s.slot]:
                pend = torch.cat(eagle.pending[s.slot])
                want = fresh.tapped[0, first : len(toks) - 1]
                torch.testing.assert_close(pend.float(), want.float(), atol=2e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10 and hits == {"deep", "root"}, (checked, hits)
    assert (sum(deep) > 0) == bool(topk), sum(deep)
    assert_same(seqs, reference[4:])
    helpers.assert_speculated(seqs)
    trees = [s.tree_rounds for s in seqs]
    assert all(t > 0 for s, t in zip(seqs, trees) if s.params.seed is None)
    assert all(t == 0 for s, t in zip(seqs, trees) if s.params.seed is not None)  # chains
    assert engine.drafter_failures == 0


@pytest.mark.parametrize("topk", [0, 4], ids=["leaves", "expanded"])
def test_a_stop_token_inside_a_tree_path_ends_the_output_there(
    real_fp32, prompts, reference, head, topk
):
    """Stop tokens under draft trees: every request stops at the first occurrence of its stop
    token, as plain greedy does (the reference cut after it, finish "stop"), whether the stop
    came as a verify's bonus token or as a node of the accepted path; some stops were accepted
    nodes of a tree round with nodes after them cut, and both caches end empty."""
    from engine.kcontrol.controller import FixedK

    engine = helpers.engine_for(
        real_fp32[0], "eagle3", slots=8, max_len=1024, head=head,
        controller=FixedK(3, 4) if not topk else FixedK(2, 6), tree_topk=topk,
    )  # fmt: skip
    want = {}  # request id -> the reference cut after the stop token's first occurrence
    for n, (ids, ref) in enumerate(zip(prompts, reference)):
        firsts = [i for i in range(4, len(ref)) if ref[i] not in ref[:i]]  # first occurrences
        # up to three stops a prompt: its first new token from position 4, 12 and 20 on
        for i in sorted({next((i for i in firsts if i >= s), -1) for s in (4, 12, 20)} - {-1}):
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=(ref[i],))
            engine.add_request(f"p{n}-{i}", ids, params, SpecParams(k=3))
            want[f"p{n}-{i}"] = ref[: i + 1]
    got, inside = {}, 0
    while engine.has_work():
        for out in engine.step():
            if not out.finished:
                continue
            assert out.seq is not None
            got[out.request_id] = (out.seq.output_ids, out.finish_reason)
            st = out.stats
            if st is not None and st.leaves and st.emitted <= st.accepted:  # an accepted node
                inside += st.accepted > st.emitted  # and the path's nodes after it were cut
    assert got == {r: (ref, "stop") for r, ref in want.items()}
    assert inside > 0
    assert engine.target.cache.used_tokens() == 0 and engine.drafter.cache.used_tokens() == 0
    assert engine.drafter_failures == 0


def test_self_draft_accepts_everything(real_fp32, prompts, reference):
    engine = real_engine(real_fp32, "self")
    rounds = []
    seqs = run_each(
        engine,
        prompts[::2],  # half (the CI's time): the ragged-batch test below runs them all
        k=3,
        on_step=lambda outs: rounds.extend(o for o in outs if o.stats is not None),
    )
    assert_same(seqs, reference[::2])
    drafted, accepted = helpers.assert_speculated(seqs, can_reject=False)
    assert drafted == accepted  # acceptance 1.0
    for o in rounds:  # K+1 tokens per target pass, except where max_tokens or EOS cut the round
        assert o.stats.accepted == o.stats.drafted == o.stats.k
        assert o.stats.emitted == o.stats.k + 1 or o.finished


def test_early_layers_draft_exercises_rejections(real_fp32, prompts, reference):
    seqs = run_each(real_engine(real_fp32, "layers", num_layers=8), prompts[:4], k=2)
    assert_same(seqs, reference[:4])
    drafted, accepted = helpers.assert_speculated(seqs)
    assert drafted - accepted > 10  # many rejections, all recovered exactly


def test_bf16_draft_model_high_acceptance(real_fp32, prompts, reference):
    seqs = run_each(real_engine(real_fp32, "self", dtype="bfloat16"), prompts[:3], k=4)
    assert_same(seqs, reference[:3])
    drafted, accepted = helpers.assert_speculated(seqs, can_reject=False)
    assert accepted > 0.8 * drafted


@pytest.mark.parametrize(
    "method,extra,k",
    [("ngram", {}, 4), ("suffix", {}, 4), ("self", {}, 3), ("layers", {"num_layers": 15}, 2)],
)
def test_ragged_batch_is_lossless(real_fp32, prompts, reference, method, extra, k):
    engine = real_engine(real_fp32, method, **extra)
    assert len({len(p) for p in prompts}) > 4  # prompts of different lengths
    seqs = engine.generate(prompts, GREEDY, SpecParams(k=k))
    assert_same(seqs, reference)
    helpers.assert_speculated(seqs, can_reject=method != "self")
    assert engine.target.cache.used_tokens() == 0 and engine.target.cache.num_free() == 8


def test_kv_caches_equal_fresh_prefill_after_every_round(real_fp32, prompts):
    engine = real_engine(real_fp32, "layers", num_layers=15)
    draft = engine.drafter.runner
    fresh = real_engine(real_fp32, "none").target
    slot = fresh.cache.allocate()
    params = SamplingParams(temperature=0, max_tokens=20)
    seqs = [
        engine.add_request(f"r{i}", p, params, SpecParams(k=3)) for i, p in enumerate(prompts[3:5])
    ]
    checked = 0
    while engine.has_work():
        engine.step()
        for s in seqs:
            if s.status is not Status.RUNNING:
                continue
            toks = s.tokens
            # target: cache holds toks[:-1]; feeding the last token must give fresh-prefill logits
            assert engine.target.cache.lengths[s.slot] == len(toks) - 1
            got = engine.target.forward([toks[-1:]], [s.slot]).logits[0]
            fresh.cache.rollback(slot, 0)
            want = fresh.forward([toks], [slot]).logits[0]
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            # draft: its committed prefix, continued with the rest, equals a fresh draft prefill
            n = draft.cache.lengths[s.slot]
            assert n <= len(toks) - 1
            got = draft.forward([toks[n:]], [s.slot]).logits[0]
            draft.cache.allocate(7)
            want = draft.forward([toks], [7]).logits[0]
            draft.cache.free(7)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            checked += 1
    assert checked >= 8
    helpers.assert_speculated(seqs)


@pytest.mark.parametrize("method", ["ngram", "suffix", "self"])
def test_seeded_sampling_reproduces_and_seeds_differ(real_fp32, prompts, method):
    """Suffix: the second run of a seed follows the first in the shared index, which a seeded
    request does not read (its draws follow its drafts)."""
    engine = real_engine(real_fp32, method)

    def sample(seed):
        p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=seed)
        s = engine.generate([prompts[2]], p, SpecParams(k=3))[0]
        assert s.drafted > 0  # a forced K speculates (seeded requests never do by default)
        return s.output_ids

    a, b, c = sample(11), sample(11), sample(12)
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "method,extra", [("ngram", {}), ("self", {}), ("layers", {"num_layers": 15})]
)
def test_adaptive_k_is_lossless(real_fp32, prompts, reference, method, extra):
    """Adaptive K (the default controller, measured costs of this machine), batched: exact."""
    engine = real_engine(real_fp32, method, **extra)
    # Probes every few rounds whatever this machine's costs say: the goodput rule may keep a
    # costly drafter (self) plain throughout, and the test needs rounds of both kinds.
    engine.controller.prober.budget = 1.0
    rounds = []
    seqs = engine.generate(
        prompts,
        GREEDY,
        SpecParams(),
        on_step=lambda outs: rounds.extend(o.stats for o in outs if o.stats is not None),
    )
    assert_same(seqs, reference)
    assert engine.controller.calibrated and engine.controller.cost.observed > 0
    assert all(0 <= r.k <= engine.k_max for r in rounds)
    drafted, accepted = helpers.assert_speculated(seqs, can_reject=False)
    if method == "self":  # whenever it drafted, everything was accepted
        assert drafted == accepted
    assert engine.target.cache.used_tokens() == 0 and engine.target.cache.num_free() == 8
