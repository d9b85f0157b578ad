"""The suffix drafter (engine/drafters/suffix.py) and its index (engine/drafters/suffix_index.py):
what it matches and counts, its memory bounds under a storm of requests, and drafts that come
from another request's output -- through the drafter and through the engine."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine.drafters.suffix import SuffixDrafter
from engine.drafters.suffix_index import COMPACT_FLOOR, SuffixIndex, matched
from engine.kcontrol.controller import FixedK
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import Sequence
from engine.round.draft_tree import grow
from tests import helpers

DEPTH = 24


def own(tokens):
    ix = SuffixIndex()
    ix.extend(ix.open(), list(tokens))
    return ix


def draft(tokens, k, factor=8.0, min_prob=0.0, depth=DEPTH, branches=0):
    ix = own(tokens)
    return ix.draft(ix.texts[0], k, depth, factor, min_prob, branches=branches)


def seq(prompt, output=(), seed=None, temperature=0.0):
    params = SamplingParams(temperature=temperature, seed=seed)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return Sequence("r", list(prompt), params, SpecParams(), gen, output_ids=list(output))


def ask(drafter, seqs, k):
    prop = drafter.propose(seqs, SimpleNamespace(ks=[k] * len(seqs)))
    assert prop.probs is None  # a copy: q one-hot
    return [row[:n] for row, n in zip(prop.tokens.tolist(), prop.num)]


def finish(drafter, prompt, output):
    """A request through ``drafter``: added, its output committed, removed."""
    s = seq(prompt)
    drafter.add([s])
    s.append(list(output))
    drafter.commit([s])
    drafter.remove(s)


# -- the index: matches and counts -----------------------------------------------------------------
def test_copies_what_followed_the_longest_match():
    #      0  1  2  3  4  5  6  7  (the context ends in 2 3: earlier at 1-2 -> 4 5 9)
    d = draft([1, 2, 3, 4, 5, 9, 2, 3], 3)
    assert (d.tokens, d.match, d.probs) == ([4, 5, 9], 2, [1.0, 1.0, 1.0])
    # the longer match (7 8 1, once) wins over the more frequent shorter one (8 1, twice more)
    d = draft([7, 8, 1, 5, 0, 8, 1, 6, 0, 8, 1, 6, 7, 8, 1], 1)
    assert (d.tokens, d.match) == ([5], 3)


def test_the_most_frequent_continuation_with_its_share():
    # 4 follows [1, 2] three times, 9 once: 4 with 3/4; then 5 after all three of those
    d = draft([1, 2, 4, 5, 1, 2, 9, 0, 1, 2, 4, 5, 3, 1, 2, 4, 5, 6, 1, 2], 2)
    assert d.tokens == [4, 5] and d.match == 2 and d.sources == 4
    assert d.probs == pytest.approx([0.75, 0.75])
    # min_token_prob stops a draft whose running probability falls below it
    toks = [1, 2, 4, 5, 1, 2, 4, 6, 1, 2, 4, 5, 1, 2, 4, 7, 1, 2]  # 4, then 5 / 6 / 7 (2:1:1)
    assert draft(toks, 3, min_prob=0.0).probs == pytest.approx([1.0, 0.5, 0.5])  # 4 5 1
    assert draft(toks, 3, min_prob=0.6).tokens == [4]  # 4 (1.0), 5 at 0.5 < 0.6
    assert draft(toks, 3, min_prob=0.5).tokens == [4, 5, 1]


def test_length_follows_the_match_and_the_k_asked():
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4]  # matches 3 1 4 (length 3), then 1 5 9 2 ...
    assert draft(toks, 8, factor=1.0).tokens == [1, 5, 9]  # 1 token per matched token
    assert draft(toks, 8, factor=2.0).tokens == [1, 5, 9, 2, 6, 5]
    assert draft(toks, 2, factor=2.0).tokens == [1, 5]  # never past the K asked
    assert draft(toks, 8, factor=0.1).tokens == [1]  # at least one
    assert draft(toks, 0).tokens == []
    assert draft([1, 2, 3, 4], 3).tokens == []  # the last token never occurred before
    assert draft([5], 3).tokens == []


def occurrences(text, depth):
    """By brute force: every earlier position with a continuation whose match with the text's
    end is the longest, the most recent first; and that length."""
    n = len(text)
    ms = {p: matched(text, p, text, depth) for p in range(1, n)}
    best = max(ms.values(), default=0)
    return sorted((p for p, m in ms.items() if m == best), reverse=True), best


def reference(text, k, depth, factor, min_prob):
    """The rule written out, by brute force: every earlier position with a continuation, its
    match with the text's end; the longest; then token by token the most frequent next token
    (ties: the most recent occurrence's) while the running share stays >= min_prob."""
    n = len(text)
    occ, best = occurrences(text, depth)
    if best == 0:
        return []
    out, cum = [], 1.0
    for j in range(min(k, max(1, int(factor * best)))):
        votes = {}
        for p in occ:
            if p + j < n:
                votes[text[p + j]] = votes.get(text[p + j], 0) + 1
        if not votes:
            break
        tok = max(votes, key=votes.__getitem__)
        if cum * votes[tok] / len(occ) < min_prob:
            break
        cum *= votes[tok] / len(occ)
        out.append(tok)
        occ = [p for p in occ if p + j < n and text[p + j] == tok]
    return out


def test_random_texts_follow_the_rule_written_out():
    """Small vocabularies (many repeats, many ties) and every depth / factor / threshold: the
    index's draft is the brute-force rule's, and the anchors' shortcut loses no match."""
    rng = random.Random(0)
    drafted = 0
    for _ in range(600):
        vocab = rng.choice([2, 3, 5])
        text = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        k, depth = rng.randrange(0, 9), rng.choice([1, 3, 24])
        factor, min_prob = rng.choice([0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4])
        got = draft(text, k, factor, min_prob, depth).tokens
        assert got == reference(text, k, depth, factor, min_prob), (text, k, depth)
        drafted += bool(got)
    assert drafted > 300


def off_chain(text, chain, depth, min_prob):
    """By brute force: every continuation of the longest match's occurrences that is no prefix
    of the draft ``chain`` and no longer than it, with its occurrences' share, if >= min_prob."""
    occ, _ = occurrences(text, depth)
    paths = {tuple(text[p : p + j]) for p in occ for j in range(1, len(chain) + 1)}
    paths = {q for q in paths if len(q) <= len(chain) and list(q) != chain[: len(q)]}
    share = {q: sum(tuple(text[p : p + len(q)]) == q for p in occ) / len(occ) for q in paths}
    return {q: v for q, v in share.items() if v >= min_prob}


def paths_of(d):
    """Each branch of draft ``d`` as its tokens from the root, through its parents."""
    n, out = len(d.tokens), []
    for tok, _, parent in d.branches:
        above = list(d.tokens[: parent + 1]) if parent < n else list(out[parent - n])
        out.append(above + [tok])
    return [tuple(p) for p in out]


def test_branches_are_the_best_other_continuations_on_random_texts():
    """Where the match's occurrences part ways, the draft's branches are the best ``most``
    continuations off its chain by their occurrences' share (brute force over every
    continuation), each at most as deep as the chain, above min_prob, its parent the
    continuation one token shorter (on the chain or an earlier branch), with its share."""
    rng = random.Random(5)
    branched = 0
    for _ in range(400):
        vocab = rng.choice([2, 3, 4])
        text = [rng.randrange(vocab) for _ in range(rng.randrange(2, 40))]
        k, depth, most = rng.randrange(1, 7), rng.choice([2, 24]), rng.randrange(1, 6)
        factor, min_prob = rng.choice([1.0, 3.0]), rng.choice([0.0, 0.1, 0.3])
        d = draft(text, k, factor, min_prob, depth, branches=most)
        assert d.tokens == reference(text, k, depth, factor, min_prob)
        want = off_chain(text, d.tokens, depth, min_prob)
        got = paths_of(d)
        assert len(set(got)) == len(got) and all(q in want for q in got), (text, got, want)
        assert [p for _, p, _ in d.branches] == pytest.approx([want[q] for q in got])
        for i, (_, _, parent) in enumerate(d.branches):
            assert parent < len(d.tokens) + i  # parents first
        best = sorted(want.values(), reverse=True)[:most]
        assert sorted((want[q] for q in got), reverse=True) == pytest.approx(best)
        branched += len(got) > 1
    assert branched > 50


def test_branches_under_the_draft():
    toks = [1, 2, 4, 5, 1, 2, 4, 6, 1, 2, 4, 5, 1, 2, 4, 7, 1, 2, 9, 9, 1, 2]
    #  after 1 2: 9 9 | 4 7 | 4 5 | 4 6 | 4 5 (the most recent first): 4 5 1 2, then 9, 7, 6
    d = draft(toks, 4, branches=5)
    assert d.tokens == [4, 5, 1, 2] and d.probs == pytest.approx([0.8, 0.4, 0.4, 0.4])
    # ties in the order found: the root's 9, then 4's 7 and 6, then under 9 and 7
    assert d.branches == [(9, 0.2, -1), (7, 0.2, 0), (6, 0.2, 0), (9, 0.2, 4), (1, 0.2, 5)]
    assert draft(toks, 4, min_prob=0.3, branches=5).branches == []  # each 1 in 5
    assert draft(toks, 4).branches == []  # none asked
    assert draft(toks, 1, branches=5).branches == [(9, 0.2, -1)]  # no deeper than the draft


def test_the_drafter_proposes_its_branches_as_a_tree():
    """A row given leaves proposes its branches as point-mass candidates of ``more`` (no
    runners-up); the engine's tree (draft_tree.grow) holds exactly the chain and, under the
    nodes they continue, the branches: every path of the tree followed the match. A row given
    none drafts its chain alone."""
    d = SuffixDrafter(max_spec_factor=8.0, min_token_prob=0.0)
    toks = [1, 2, 4, 5, 1, 2, 4, 6, 1, 2, 4, 5, 1, 2, 4, 7, 1, 2, 9, 9, 1, 2]
    rows = [seq(toks), seq([3] + toks)]
    plan = SimpleNamespace(ks=[4, 4], leaves=[3, 0])
    prop = d.propose(rows, plan)
    alts = prop.alternatives
    assert prop.num == [4, 4] and alts is not None and alts.more is not None
    assert alts.tokens.shape == (2, 4, 0) and alts.point_rows == [True, True]
    assert alts.sizes == [3, 0]
    tree = grow(prop.tokens, prop.num, None, alts, [3, 0])
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    assert tokens[0][:4] == [4, 5, 1, 2] and valid[0] == [True] * 7 and not any(valid[1][4:])

    def path(b, i):
        return path(b, parents[b][i]) + [tokens[b][i]] if i >= 0 else []

    assert sorted(path(0, i) for i in range(4, 7)) == [[4, 6], [4, 7], [9]]
    assert tree.width == 3  # the root's 4 and 9; 4's 5, 7 and 6
    assert d.propose(rows, SimpleNamespace(ks=[4, 4], leaves=[0, 0])).alternatives is None


# -- the bounds and the clean-up ---------------------------------------------------------------
def test_a_storm_of_requests_stays_within_the_bounds():
    """1,000 requests through the drafter, 3 at a time, each committed round by round and
    removed: the shared index keeps at most its requests and tokens (the least recently used
    pushed out), its n-gram lists at most about twice its live positions, and no request's own
    state outlives it. The latest outputs still draft; one pushed out long ago no longer does."""
    d = SuffixDrafter(max_cached_requests=50, max_cached_tokens=2000)
    rng = random.Random(1)
    shared = d.shared
    assert shared is not None
    first = None
    running: list[Sequence] = []
    for _ in range(1000):
        s = seq([rng.randrange(1000) for _ in range(5)])
        d.add([s])
        running.append(s)
        for r in running:  # a round: each running row commits a few tokens
            r.append([rng.randrange(50_000) for _ in range(rng.randrange(1, 8))])
        d.commit(running)
        if len(running) == 3:
            done = running.pop(0)
            d.remove(done)
            first = first or list(done.output_ids)
        assert len(shared) <= 50 and shared.tokens <= 2000
        filed = shared._filed  # entries a text of n tokens files
        assert shared.live_entries == sum(filed(len(t)) for t in shared.texts.values())
        assert shared.entries <= 2 * shared.live_entries + 4096
    for r in running:
        d.remove(r)
    assert d.rows == {}
    assert shared.evicted > 900
    last = next(t for t in reversed(shared.texts.values()) if len(t) >= 4)
    assert ask(d, [seq([7] + last[:2])], 4) == [last[2:4]]  # 2 matched: 2 drafted
    assert first is not None and ask(d, [seq([7] + first[:2])], 4) == [[]]


def test_dropped_texts_are_compacted_away():
    ix = SuffixIndex()
    ids = [ix.open() for _ in range(30)]
    for t in ids:
        ix.extend(t, list(range(t * 1000, t * 1000 + 400)))
    before = ix.entries
    for t in ids[:-1]:
        ix.drop(t)
    assert len(ix) == 1 and ix.tokens == 400
    assert ix.entries < before / 10  # the dropped texts' entries rebuilt away ...
    assert ix.entries <= 2 * ix.live_entries + COMPACT_FLOOR  # ... whenever they outnumber
    assert len(ix.grams) <= ix.entries
    assert ix.draft([5, 1000 * ids[0] + 7], 3, DEPTH, 8.0, 0.0).tokens == []  # dropped: gone
    last = 1000 * ids[-1]
    assert ix.draft([5, last + 7], 3, DEPTH, 8.0, 0.0).tokens == [last + 8, last + 9, last + 10]


def test_a_text_longer_than_the_token_bound_keeps_its_start():
    ix = SuffixIndex(max_texts=4, max_tokens=10)
    a = ix.open()
    ix.extend(a, list(range(25)))
    assert ix.tokens == 10 and ix.texts[a] == list(range(10))
    b = ix.open()
    ix.extend(b, [1, 2, 3])
    assert a not in ix.texts and ix.tokens == 3  # the older text went to make room


# -- drafts from another request ------------------------------------------------------------------
def test_a_request_drafts_what_an_earlier_request_wrote():
    """A's output is committed and A removed; B's prompt does not hold it, but B's text ends in
    its start: B drafts A's continuation, from the shared index. With the shared index off (no
    cached requests) B drafts nothing, and a seeded sampled B (whose draws follow its drafts)
    does not read other requests' outputs."""
    answer = [50, 51, 52, 53, 54, 55, 56, 57]

    def after_a(cached):
        d = SuffixDrafter(max_cached_requests=cached, max_spec_factor=2.0)
        a = seq([1, 2, 3])
        d.add([a])
        for i in range(0, len(answer), 2):  # committed two tokens a round
            a.append(answer[i : i + 2])
            d.commit([a])
        d.remove(a)
        return d

    for cached, want in ((1000, [answer[3:8]]), (0, [[]])):
        d = after_a(cached)
        b = seq([9, 9, 8], output=answer[:3])  # B's own text: 9 9 8 50 51 52
        d.add([b])
        assert ask(d, [b], 5) == want
        assert d.last_sources == (["shared"] if cached else [""])
    seeded = seq([9, 9, 8], output=answer[:3], seed=3, temperature=0.8)
    greedy = seq([9, 9, 8], output=answer[:3], seed=3)  # greedy: the seed draws nothing
    unseeded = seq([9, 9, 8], output=answer[:3], temperature=0.8)
    assert ask(after_a(1000), [seeded, greedy, unseeded], 5) == [[], answer[3:8], answer[3:8]]


def test_its_own_text_beats_a_weaker_shared_match():
    d = SuffixDrafter(max_spec_factor=4.0)
    finish(d, [1], [20, 21, 30, 31])
    b = seq([5, 6, 7, 20, 21, 40, 41, 5, 6, 7, 20], output=[21])  # own: 5 6 7 20 21 -> 40 41
    assert ask(d, [b], 2) == [[40, 41]] and d.last_sources == ["own"]
    c = seq([9, 20], output=[21])  # only the shared index has 20 21 before
    assert ask(d, [c], 2) == [[30, 31]] and d.last_sources == ["shared"]


@pytest.fixture(scope="module")
def target():
    return helpers.tiny_llama(5, vocab=48)


def test_through_the_engine_b_copies_a_and_stays_exact(target):
    """Greedy requests A then B with the same prompt (B's prompt does not hold A's output, its
    own output repeats it): output equals plain decoding, and B's drafts came from A's output
    -- the shared index drafted B's rows, and B took more tokens per pass than A did. With the
    shared index off, B drafts only from its own text and gains nothing from A."""
    prompt = [3, 17, 40, 8, 22, 5, 31]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = helpers.engine_for(target, None).generate([prompt], params)[0].output_ids
    runs = {}
    for cached in (1000, 0):
        engine = helpers.engine_for(target, "suffix", controller=FixedK(6))
        engine.drafter.shared = None if cached == 0 else engine.drafter.shared
        a = engine.generate([prompt], params, SpecParams(k=6))[0]
        own_a = engine.drafter.own_drafts
        b = engine.generate([prompt], params, SpecParams(k=6))[0]
        assert a.output_ids == b.output_ids == plain
        runs[cached] = (a, b, engine.drafter.shared_drafts, engine.drafter.own_drafts - own_a)
    a, b, shared_rows, _ = runs[1000]
    helpers.assert_speculated([b], can_reject=False)
    assert shared_rows > 0 and b.accepted > a.accepted
    assert b.target_passes < a.target_passes
    assert b.accepted == b.drafted  # every copy of A's greedy output is the target's
    a0, b0, shared0, _ = runs[0]
    assert shared0 == 0 and b0.accepted == a0.accepted and b0.target_passes == a0.target_passes


def test_a_seeded_request_reproduces_whatever_traffic_came_before(monkeypatch):
    """A seeded sampled request gives the same output on a fresh engine and on one whose shared
    index holds other requests' outputs; the control: let it read the shared index and the
    same request, after the same traffic, drafts from it and parts from its fresh output."""
    prompt = [3, 17, 40, 8, 22, 5, 31]
    target = helpers.tiny_llama(5, vocab=48, sharpen=4.0)  # sampled drafts that get accepted

    def run(traffic, read_all=False):
        if read_all:
            monkeypatch.setattr(SuffixDrafter, "reads_shared", staticmethod(lambda s: True))
        engine = helpers.engine_for(target, "suffix", controller=FixedK(4))
        if traffic:  # greedy and unseeded answers to the same prompt
            others = [SamplingParams(temperature=t, max_tokens=40) for t in (0, 1.0, 1.0, 0.7)]
            engine.generate([prompt] * 4, others, SpecParams(k=4))
        before = engine.drafter.shared_drafts
        params = SamplingParams(temperature=1.0, max_tokens=40, seed=11)
        s = engine.generate([prompt], params, SpecParams(k=4))[0]
        monkeypatch.undo()
        return s, engine.drafter.shared_drafts - before

    fresh, _ = run(False)
    after, copied = run(True)
    assert copied == 0 and after.output_ids == fresh.output_ids
    helpers.assert_speculated([fresh, after])
    control, copied = run(True, read_all=True)
    assert copied > 0 and control.output_ids != fresh.output_ids


# -- draft trees through the engine ---------------------------------------------------------------
def test_trees_through_the_engine_greedy_equals_plain(monkeypatch):
    """fp32 greedy, 32 prompts of a vocabulary of 8 in one batch (the match's occurrences often
    part ways), the suffix drafter at K = 4 with 3 leaves: output equals plain decoding's; trees
    of several branches were verified, and rows took a branch, not the chain's token, where the
    target went that way. With no leaves the same run verifies chains only."""
    from engine.round import speculator

    target = helpers.sharp_tiny(1, 8)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 8, (int(n),), generator=g).tolist() for n in range(2, 34)]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = helpers.engine_for(target, None, slots=64, max_len=64).generate(prompts, params)
    widest = []  # per tree round, the most branches a row had verified
    real_grow = speculator.grow

    def spy(*a, **kw):
        tree = real_grow(*a, **kw)
        widest.append(int(tree.valid[:, tree.chain :].sum(1).max()))
        return tree

    monkeypatch.setattr(speculator, "grow", spy)
    for leaves in (3, 0):
        engine = helpers.engine_for(
            target, "suffix", slots=64, max_len=64, controller=FixedK(4, leaves)
        )
        seqs = engine.generate(prompts, params, SpecParams(k=4))
        assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
        helpers.assert_speculated(seqs)
        trees, hits = sum(s.tree_rounds for s in seqs), sum(s.leaf_hits for s in seqs)
        if leaves:
            assert trees > 10 and hits > 0 and max(widest) >= 2, (trees, hits, widest)
        else:
            assert trees == hits == 0
