"""EAGLE-3 with the per-row n-gram fallback (engine/drafters/hybrid.py): exact either way."""

from __future__ import annotations

import numpy as np
import pytest

from engine.drafters.eagle import EagleDrafter
from engine.drafters.hybrid import HybridDrafter
from engine.drafters.ngram import ngram_match
from engine.k_control import FixedK
from engine.sampling import SamplingParams
from engine.sequence import SpecParams
from tests import helpers
from tests.engine.test_eagle import HIDDEN, LAYERS, VOCAB, draws, echo_head, random_head


def hybrid_engine(target, head, slots=4, k=3, min_match=2):
    """Copies where a row's last ``min_match``+ tokens occurred before, else the head drafts."""
    engine = helpers.engine_for(target, "eagle3+ngram", slots, controller=FixedK(k), head=head)
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


@pytest.mark.usefixtures("single_thread")
def test_sampled_distribution_matches_target():
    """4,000 seeded requests of 4 tokens at T = 0.8, K = 2: a row copies (one-hot q) where its
    last token occurred before (half of the vocabulary is in the prompt), the head drafts with
    its own q otherwise; chi-square against the exact target distribution at significance 1e-3.
    The same test rejects copies that report a q other than one-hot."""
    small = helpers.tiny_llama(
        1, layers=LAYERS, vocab=12, hidden=32, heads=2, kv_heads=1, max_positions=64, sharpen=8.0
    )
    prompt, temp = [0, 1, 2, 3, 4, 5], 0.8
    exact = helpers.exact_joint(small, prompt, 4, temp)
    head = random_head(9, vocab=12, draft_vocab=8, hidden=32)
    engine = hybrid_engine(small, head, 1024, 2, min_match=1)
    _, p, df = helpers.chi_square_gof(draws(engine, prompt, temp), exact)
    hybrid = engine.drafter
    assert hybrid.copied > 1000 and hybrid.headed > 1000, (hybrid.copied, hybrid.headed)
    assert df > 10
    assert p > 1e-3, f"p = {p:.2e}: the sampled output is not the target's distribution"

    wrong = hybrid_engine(small, head, 1024, 2, min_match=1)
    d = wrong.drafter
    propose = d.propose

    def copies_misreported(seqs, plan):  # the copied rows' q: half one-hot, half uniform
        prop = propose(seqs, plan)
        rows = d.last_copied
        prop.probs[rows] = 0.5 * prop.probs[rows] + 0.5 / prop.probs.shape[-1]
        return prop

    d.propose = copies_misreported
    _, p_wrong, _ = helpers.chi_square_gof(draws(wrong, prompt, temp), exact)
    print(f"eagle3+ngram: right q p = {p:.3g}, misreported copies' q p = {p_wrong:.3g}")
    assert p_wrong < 1e-3


def test_fallback_must_fit_the_lookup():
    with pytest.raises(ValueError, match="ngram_fallback"):
        HybridDrafter(None, 5, 4)  # type: ignore[arg-type]
