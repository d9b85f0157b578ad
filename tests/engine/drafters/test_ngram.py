from types import SimpleNamespace

import numpy as np
import torch

from engine.drafters.ngram import NgramDrafter, ngram_lookup
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import Sequence


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


def humaneval_tokens(tasks: int = 40) -> list[list[int]]:
    """Real code: HumanEval's first ``tasks`` prompts with their canonical solutions, split into
    words, punctuation and newlines, each a token id (one vocabulary over all)."""
    import gzip
    import json
    import re

    from prompts.sets import humaneval_file

    with gzip.open(humaneval_file(), "rt") as f:
        texts = [t["prompt"] + t["canonical_solution"] for t in map(json.loads, f)][:tasks]
    vocab: dict[str, int] = {}
    words = (re.findall(r"\w+|[^\w\s]|\n", text) for text in texts)
    return [[vocab.setdefault(w, len(vocab)) for w in ws] for ws in words]


def copied_after(tokens: list[int], k: int, pick, max_n: int = 3) -> list[int]:
    """The n-gram rule written out: the longest suffix n-gram (max_n down to 1) that occurred
    earlier; of its occurrences, ``pick`` chooses the one whose continuation is copied (k
    tokens, or fewer at the end)."""
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        starts = [i + n for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
        if starts:
            start = pick(starts, [s for s in starts if s + k <= len(tokens)])
            return tokens[start : start + k]
    return []


def test_drafts_on_real_code_copy_what_followed_the_latest_match():
    """At every position of real code (HumanEval), the drafter proposes what followed the most
    recent earlier occurrence of the longest matching suffix (a full continuation preferred):
    the rule written out. What it proposes is good: a greedy verify of the code itself would
    accept more than half a token per proposal, more than copying after the oldest occurrence
    or one token off does (the controls: the measure tells a wrong copy from the right one)."""
    k = 4
    latest = lambda starts, full: full[-1] if full else starts[0]  # noqa: E731
    oldest = lambda starts, full: starts[0]  # noqa: E731
    d = NgramDrafter("cpu")
    accepted = {"drafter": 0, "oldest": 0, "one off": 0}
    proposals = 0
    for toks in humaneval_tokens():
        at = range(8, len(toks) - k)
        seqs = [Sequence("x", toks[:i], SamplingParams(), SpecParams()) for i in at]
        prop = d.propose(seqs, SimpleNamespace(ks=[k] * len(seqs)))
        for i, row, num in zip(at, prop.tokens.tolist(), prop.num):
            drafted, truth = row[:num], toks[i : i + k]
            assert drafted == copied_after(toks[:i], k, latest)
            proposals += num > 0
            ahead = copied_after(toks[:i], k + 1, latest)[1:]  # one token past the right copy
            for name, draft in (
                ("drafter", drafted),
                ("oldest", copied_after(toks[:i], k, oldest)),
                ("one off", ahead),
            ):
                accepted[name] += next(
                    (j for j, (a, b) in enumerate(zip(draft, truth)) if a != b),
                    min(len(draft), len(truth)),
                )
    assert proposals > 3000
    assert accepted["drafter"] > 0.5 * proposals
    assert accepted["drafter"] > 1.1 * accepted["oldest"]
    assert accepted["drafter"] > 3 * accepted["one off"]
