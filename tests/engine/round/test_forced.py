"""engine/drafters/forced.py: tokens a grammar forces are drafted for free. Over the tiny
byte-vocabulary byte_models of test_grammar.py: with a grammar that forces a 5-byte run, greedy
output equals plain decoding while a whole run costs one verify pass and no drafting step; sampled
rows keep the run too; a seeded row without its own K never gets one (its draws must not depend on
drafting). The sampled distribution under forced drafts is test_grammar.py's chi-square test (its
pattern forces a token), which asserts that forced runs were drafted."""

import re
from types import SimpleNamespace

import pytest
import torch

from engine.drafters.forced import forced_run, with_forced
from engine.records.params import SamplingParams, SpecParams
from tests.grammar_builders import engine, text

llguidance = pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("single_thread")

PATTERN = r"[ab]cabca[ab]"  # after the first byte, "cabca" is forced
GRAMMAR = llguidance.LLMatcher.grammar_from_regex(PATTERN)
PROMPT = [ord(c) for c in "abcab"]


def test_with_forced_replaces_forced_rows_and_widens():
    drafts = torch.tensor([[5, 6], [7, 0]])  # [batch, K]
    q = torch.softmax(torch.randn(2, 2, 10), -1)  # [batch, K, vocab]
    out, num, probs = with_forced(drafts, [2, 1], q, [[], [1, 2, 3]])
    assert out.tolist() == [[5, 6, 0], [1, 2, 3]] and num == [2, 3]
    assert torch.equal(probs[0, :2], q[0])  # the drafter's row is untouched
    assert torch.equal(probs[1], torch.eye(10)[[1, 2, 3]])  # q one-hot on the run
    assert drafts.tolist() == [[5, 6], [7, 0]]  # inputs not modified
    out, num, probs = with_forced(drafts, [2, 1], None, [[4], []])
    assert out.tolist() == [[4, 0], [7, 0]] and num == [1, 1] and probs is None


def test_forced_run_is_capped_read_only_and_skips_seeded_rows(byte_tok):
    def row(**params):
        m = llguidance.LLMatcher(byte_tok, GRAMMAR)
        assert m.consume_tokens([ord("a")])  # the first byte is free, then "cabca" is forced
        return SimpleNamespace(matcher=m, params=SamplingParams(**params), spec=SpecParams())

    g = row(temperature=0)
    assert forced_run(g, 8) == list(b"cabca") and forced_run(g, 2) == list(b"ca")
    assert forced_run(g, 8) == list(b"cabca")  # reading it did not move the matcher
    assert forced_run(g, 0) == []  # cap 0: speculation off, or no room
    assert forced_run(row(temperature=1.0), 8) == list(b"cabca")
    s = row(temperature=1.0, seed=3)
    assert forced_run(s, 8) == []  # seeded, K pinned to 0 for reproducibility
    s.spec = SpecParams(k=2)  # with its own K a seeded row drafts: so may it the forced run
    assert forced_run(s, 8) == list(b"cabca")
    assert g.matcher.consume_tokens(list(b"cabcab")) and forced_run(g, 8) == []


def _spy_drafter(e, asked: list):
    inner = e.speculator.drafter.propose

    def propose(seqs, plan):
        asked.append(list(plan.ks))
        return inner(seqs, plan)

    e.speculator.drafter.propose = propose


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_forced_run_costs_one_pass_and_equals_plain(byte_models, byte_tok, drafter):
    params = [
        SamplingParams(temperature=0, max_tokens=7, grammar=GRAMMAR),
        SamplingParams(temperature=0, max_tokens=7),  # a free row beside it drafts as usual
    ]
    e, asked = engine(byte_models, byte_tok, drafter), []
    _spy_drafter(e, asked)
    spec = e.generate([PROMPT] * 2, params, SpecParams(k=3))
    plain = engine(byte_models, byte_tok, None).generate([PROMPT] * 2, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert re.fullmatch(PATTERN, text(spec[0].output_ids))
    # the prefill's pass gives the first byte, one round the 5 forced bytes and the last one
    assert spec[0].target_passes == 2 and spec[0].drafted == 0
    assert asked[0] == [0, 3]  # its one round: the drafter asked for the free row only
    assert all(len(ks) == 1 for ks in asked[1:])  # then the free row went on alone


def test_sampled_rows_keep_the_forced_run(byte_models, byte_tok):
    n = 16
    params = [SamplingParams(temperature=1.0, max_tokens=7, grammar=GRAMMAR) for _ in range(n)]
    seqs = engine(byte_models, byte_tok, "model", slots=n).generate([PROMPT] * n, params)
    assert all(re.fullmatch(PATTERN, text(s.output_ids)) for s in seqs)
    assert all(s.target_passes == 2 for s in seqs)  # the run was accepted whole every time
    seeded = [
        SamplingParams(temperature=1.0, max_tokens=7, seed=i, grammar=GRAMMAR) for i in range(4)
    ]
    alone = engine(byte_models, byte_tok, None).generate([PROMPT] * 4, seeded)
    spec = engine(byte_models, byte_tok, "model").generate([PROMPT] * 4, seeded)
    assert all(s.target_passes == 7 for s in spec)  # K = 0: one token a pass, no forced run
    assert [s.output_ids for s in spec] == [s.output_ids for s in alone]


def test_round_stats_count_forced_tokens_apart(byte_models, byte_tok):
    e = engine(byte_models, byte_tok, "ngram")
    e.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=7, grammar=GRAMMAR))
    stats = []
    while e.has_work():
        stats += [o.stats for o in e.step() if o.stats is not None]
    assert [(st.forced, st.drafted, st.accepted, st.emitted) for st in stats] == [(5, 0, 0, 6)]
