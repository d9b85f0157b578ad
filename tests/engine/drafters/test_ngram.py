from types import SimpleNamespace

import numpy as np
import torch

from engine.drafters.ngram import NgramDrafter, ngram_lookup
from engine.requests.sequence import Sequence, SpecParams
from engine.round.sampling import SamplingParams


def look(tokens, k, **kw):
    return ngram_lookup(np.asarray(tokens), k, **kw)


def test_copies_continuation_of_longest_suffix_match():
    #                0  1  2  3  4  5  6  7  8
    assert look([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]


def test_prefers_longer_ngram_over_more_recent_unigram():
    toks = [7, 8, 1, 2, 7, 5, 5, 8, 7, 8]  # suffix [7, 8] matched at 0 -> continue with [1, 2]
    assert look(toks, 2, max_n=2) == [1, 2]


def test_prefers_most_recent_full_continuation():
    toks = [1, 2, 3, 1, 2, 4, 4, 4, 1, 2]
    assert look(toks, 1) == [4]  # the later [1, 2] -> 4, not the first [1, 2] -> 3


def test_short_continuation_when_only_near_the_end():
    assert look([5, 6, 5], 4) == [6, 5]


def test_no_match_and_k_zero():
    assert look([1, 2, 3, 4], 3) == []
    assert look([1, 2, 1], 0) == []
    assert look([3], 2) == []


def test_min_n_excludes_short_matches():
    assert look([1, 2, 3, 4, 9, 4], 2, min_n=2) == []
    assert look([1, 2, 3, 4, 9, 4], 2, min_n=1) == [9, 4]


def test_proposal_is_ragged_and_one_hot():
    d = NgramDrafter("cpu")

    def mk(toks):
        return Sequence("x", toks, SamplingParams(), SpecParams())

    prop = d.propose(
        [mk([1, 2, 3, 1, 2]), mk([4, 5, 6]), mk([1, 1, 1, 1])], SimpleNamespace(ks=[3, 3, 0])
    )
    assert prop.num == [3, 0, 0] and prop.probs is None
    assert prop.tokens.shape == (3, 3) and prop.tokens[0].tolist() == [3, 1, 2]
    assert prop.tokens.dtype == torch.long
