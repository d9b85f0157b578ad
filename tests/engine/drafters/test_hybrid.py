"""EAGLE-3 with the per-row n-gram fallback (engine/drafters/hybrid.py): exact either way."""

from __future__ import annotations

import numpy as np
import pytest

from engine.drafters.eagle.drafter import EagleDrafter
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.ngram import ngram_match
from engine.kcontrol.controller import FixedK
from engine.records.params import SamplingParams, SpecParams
from tests import helpers
from tests.distribution import assert_fits, assert_rejects, exact_joint
from tests.eagle_builders import HIDDEN, LAYERS, VOCAB, draws, echo_head, random_head


def hybrid_engine(target, head, slots=4, k=3, min_match=2, copier="ngram"):
    """Copies where a row's last ``min_match``+ tokens occurred before (n-gram lookup, or the
    suffix drafter: ``copier``), else the head drafts."""
    engine = helpers.engine_for(target, f"eagle3+{copier}", slots, controller=FixedK(k), head=head)
    engine.drafter.min_match = min_match
    return engine


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)


def test_ngram_match_reports_the_suffix_it_matched():
    assert ngram_match(np.array([5, 6, 7, 1, 5, 6, 7]), 2, 1, 4) == (3, [1, 5])
    assert ngram_match(np.array([5, 6, 7, 1, 2, 3, 7]), 2, 1, 4) == (1, [1, 2])
    assert ngram_match(np.array([5, 6, 7, 1, 2, 3, 7]), 2, 2, 4) == (0, [])


def test_greedy_equals_plain_with_both_drafters_in_use(target):
    """Repetitive prompts (so the lookup finds 2-token repeats) and random ones (so the head
    drafts), ragged, more requests than slots: output equals plain decoding token for token,
    and both drafters drafted."""
    rng = np.random.default_rng(4)
    ps = [rng.integers(0, VOCAB, rng.integers(3, 30)).tolist() for _ in range(5)]
    ps += [[1, 2, 3, 4] * 5, [7, 8] * 9 + [9], [5, 5, 6, 5, 5, 6, 5]]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i) for i in range(len(ps))]
    ref = [s.output_ids for s in helpers.engine_for(target, None, 4).generate(ps, params)]
    engine = hybrid_engine(target, echo_head(target))
    out = engine.generate(ps, params, SpecParams(k=3))
    assert [s.output_ids for s in out] == ref
    hybrid = engine.drafter
    assert hybrid.copied > 0 and hybrid.headed > 0
    assert 0 < sum(s.accepted for s in out) < sum(s.drafted for s in out)
    assert isinstance(hybrid, HybridDrafter) and isinstance(hybrid.eagle, EagleDrafter)
    assert hybrid.eagle.cache.used_tokens() == 0  # every slot's head cache freed


def test_greedy_equals_plain_with_suffix_and_head_and_copies_across_requests(target):
    """The suffix drafter as the copier: the same ragged greedy batch equals plain decoding with
    both the copies and the head in use; then the same prompts again, one engine: the rows copy
    the first run's answers from the shared index, and take fewer target passes than the first
    run, exactly the same output."""
    rng = np.random.default_rng(4)
    ps = [rng.integers(0, VOCAB, rng.integers(3, 30)).tolist() for _ in range(5)]
    ps += [[1, 2, 3, 4] * 5, [7, 8] * 9 + [9], [5, 5, 6, 5, 5, 6, 5]]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i) for i in range(len(ps))]
    ref = [s.output_ids for s in helpers.engine_for(target, None, 4).generate(ps, params)]
    engine = hybrid_engine(target, echo_head(target), copier="suffix", k=4)
    hybrid = engine.drafter
    assert isinstance(hybrid, HybridDrafter) and hybrid.suffix is not None
    rounds = []
    first = engine.generate(
        ps, params, SpecParams(k=4), on_step=lambda o: rounds.extend(x.stats for x in o if x.stats)
    )
    assert [s.output_ids for s in first] == ref
    assert hybrid.copied > 0 and hybrid.headed > 0
    # the rounds say which drafts were copies (the metrics' copier share): some, not all
    copied = sum(r.drafted for r in rounds if r.copied)
    assert 0 < copied < sum(r.drafted for r in rounds)
    assert 0 < sum(s.accepted for s in first) < sum(s.drafted for s in first)
    shared_before = hybrid.suffix.shared_drafts
    again = engine.generate(ps, params, SpecParams(k=4))
    assert [s.output_ids for s in again] == ref
    assert hybrid.suffix.shared_drafts > shared_before
    assert sum(s.target_passes for s in again) < sum(s.target_passes for s in first)
    assert hybrid.eagle.cache.used_tokens() == 0 and hybrid.suffix.rows == {}


@pytest.mark.slow
def test_aborts_mid_round_leave_the_others_exact_and_free_the_head(target):
    """Sampled rows with top-k and top-p beside greedy rows, EAGLE-3 + n-gram at K = 3; two
    requests aborted while they speculate: every other request's output is the one it gets
    alone, the aborted ones stop where they were, and no slot of the target's or the head's
    cache stays used."""
    ps = [[1, 2, 3, 4] * 5, [7, 8] * 9 + [9], [5, 5, 6, 5, 5, 6, 5], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=24, seed=i)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=24)
        for i in range(len(ps))
    ]
    alone = []
    for p, prm in zip(ps, params):
        e = hybrid_engine(target, echo_head(target), slots=4)
        alone.append(e.generate([p], prm, SpecParams(k=3))[0].output_ids)
    engine = hybrid_engine(target, echo_head(target), slots=4)
    seqs = [
        engine.add_request(f"r{i}", p, prm, SpecParams(k=3))
        for i, (p, prm) in enumerate(zip(ps, params))
    ]
    while engine.has_work() and not all(len(s.output_ids) >= 6 for s in seqs):
        engine.step()
    assert all(s.drafted > 0 for s in seqs)  # every row was speculating when the aborts came
    assert engine.abort("r0") and engine.abort("r3")
    while engine.has_work():
        engine.step()
    assert [s.finish_reason for s in seqs] == ["abort", "length", "length", "abort"]
    for i in (1, 2):
        assert seqs[i].output_ids == alone[i]
    for i in (0, 3):
        assert seqs[i].output_ids == alone[i][: len(seqs[i].output_ids)]
    helpers.assert_speculated(seqs)
    assert engine.target.cache.used_tokens() == 0
    assert engine.drafter.eagle.cache.used_tokens() == 0


@pytest.mark.usefixtures("single_thread")
def test_sampled_distribution_matches_target():
    """4,000 seeded requests of 6 tokens at T = 0.8 with top-k and top-p, K = 4: a row copies
    (one-hot q) where its last token occurred before (half of the vocabulary is in the prompt),
    the head drafts with its own q otherwise; the suite's distribution test
    (tests/distribution.py). The same test rejects copies that report a q other than one-hot."""
    small = helpers.sharp_tiny(1, vocab=12, layers=LAYERS)
    prompt, sampling = [0, 1, 2, 3, 4, 5], dict(temperature=0.8, top_k=6, top_p=0.95)
    exact = exact_joint(small, prompt, 6, **sampling)
    head = random_head(9, vocab=12, draft_vocab=8, hidden=32)
    engine = hybrid_engine(small, head, 1024, 4, min_match=1)
    assert_fits(draws(engine, prompt, **sampling), exact, "eagle3+ngram")
    hybrid = engine.drafter
    assert hybrid.copied > 1000 and hybrid.headed > 1000, (hybrid.copied, hybrid.headed)

    wrong = hybrid_engine(small, head, 1024, 4, min_match=1)
    d = wrong.drafter
    propose = d.propose

    def copies_misreported(seqs, plan):  # the copied rows' q: half one-hot, half uniform
        prop = propose(seqs, plan)
        rows = d.last_copied
        prop.probs[rows] = 0.5 * prop.probs[rows] + 0.5 / prop.probs.shape[-1]
        return prop

    d.propose = copies_misreported
    assert_rejects(draws(wrong, prompt, **sampling), exact, "eagle3+ngram, copies' q misreported")


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")
def test_sampled_distribution_with_the_suffix_copier_matches_target():
    """The distribution test with the suffix drafter as the copier (seeded rows: their own
    index), copies and head drafts both many."""
    small = helpers.sharp_tiny(1, vocab=12, layers=LAYERS)
    prompt, sampling = [0, 1, 2, 3, 4, 5, 0, 1], dict(temperature=0.8, top_k=6, top_p=0.95)
    exact = exact_joint(small, prompt, 6, **sampling)
    head = random_head(9, vocab=12, draft_vocab=8, hidden=32)
    engine = hybrid_engine(small, head, 1024, 4, min_match=1, copier="suffix")
    assert_fits(draws(engine, prompt, **sampling), exact, "eagle3+suffix")
    hybrid = engine.drafter
    assert hybrid.copied > 1000 and hybrid.headed > 1000, (hybrid.copied, hybrid.headed)


def test_fallback_must_fit_the_lookup():
    with pytest.raises(ValueError, match="ngram_fallback"):
        HybridDrafter(None, 5, 4)  # type: ignore[arg-type]
