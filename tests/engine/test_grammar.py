"""engine/grammar.py: grammar-constrained output under speculation, over a tiny random model
whose vocabulary is llguidance's byte tokenizer. Greedy output with speculation equals it
without (and matches the grammar); sampled output follows the masked target's exact
distribution (with the token the grammar forces drafted for free, forced.py), by a chi-square
test that rejects an engine masking every verified position as the first (ignoring the drafts
before it)."""

import re

import pytest
import torch

from engine import round as round_module
from engine.forced import forced_run
from engine.grammar import GrammarCompiler, apply_grammar
from engine.sampling import SamplingParams, logits_to_probs
from engine.sequence import SpecParams
from tests.engine.test_engine_distribution import gof
from tests.helpers import engine_for

llguidance = pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("single_thread")

PATTERN = r"[ab]{2}c[ab]"
PROMPT = [ord(c) for c in "abcab"]


def engine(byte_models, byte_tok, drafter, slots=4):
    grammars = GrammarCompiler(None, byte_tok.vocab_size)
    grammars._tokenizer = byte_tok  # the tiny model speaks bytes
    e = engine_for(byte_models, drafter, slots=slots, chunk=10**6, max_len=16, max_prefill=slots)
    e.grammars = grammars
    return e


def text(ids: list[int]) -> str:
    return bytes(ids).decode()


GRAMMAR = llguidance.LLMatcher.grammar_from_regex(PATTERN)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_under_a_grammar_equals_plain_and_matches(byte_models, byte_tok, drafter):
    params = [
        SamplingParams(temperature=0, max_tokens=4, grammar=GRAMMAR),
        SamplingParams(temperature=0, max_tokens=4),  # a free row beside it
    ]
    spec = engine(byte_models, byte_tok, drafter).generate([PROMPT] * 2, params, SpecParams(k=3))
    plain = engine(byte_models, byte_tok, None).generate([PROMPT] * 2, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    assert re.fullmatch(PATTERN, text(spec[0].output_ids))
    assert not re.fullmatch(PATTERN, text(spec[1].output_ids))  # the model alone would not


def exact_joint_masked(model, byte_tok, temperature: float) -> dict:
    """P(output) of every output the grammar allows, by enumeration over the masked target."""
    joint: dict = {}

    def walk(prefix: list[int], pr: float) -> None:
        if len(prefix) == 4:
            joint[tuple(prefix)] = pr
            return
        m = llguidance.LLMatcher(byte_tok, GRAMMAR)
        assert m.consume_tokens(prefix)
        allowed = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8) > 0
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + prefix])).logits[0, -1].float()
        logits = logits.masked_fill(~allowed[: logits.shape[0]], float("-inf"))
        one = torch.ones(1)
        p = logits_to_probs(logits[None, None], one * temperature, one.long() * 0, one)[0, 0]
        for t in torch.nonzero(p > 0).flatten().tolist():
            walk(prefix + [t], pr * float(p[t]))

    walk([], 1.0)
    return joint


def _first_mask_everywhere(logits, seqs, drafts):
    """Wrong: every verified position masked as the first (the drafts before it ignored)."""
    return apply_grammar(logits, seqs, [[] for _ in seqs])


@pytest.mark.slow
def test_sampled_under_a_grammar_follows_the_masked_distribution(
    byte_models, byte_tok, monkeypatch
):
    joint = exact_joint_masked(byte_models[0], byte_tok, 1.0)
    n = 2000
    runs = []  # the pattern forces its "c": those rounds draft it for free (forced.py)
    monkeypatch.setattr(
        round_module, "forced_run", lambda s, cap: runs.append(forced_run(s, cap)) or runs[-1]
    )

    def run():
        e = engine(byte_models, byte_tok, "model", slots=1024)
        params = [
            SamplingParams(temperature=1.0, max_tokens=4, seed=i, grammar=GRAMMAR) for i in range(n)
        ]
        return e.generate([PROMPT] * n, params, SpecParams(k=3))

    seqs = run()
    drafted, accepted = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
    assert drafted > n and 0.05 < accepted / drafted < 0.95
    stat, p, df = gof(seqs, joint)
    print(f"grammar, draft model, T=1: chi2 = {stat:.1f}, df = {df}, p = {p:.3g}")
    assert all(tuple(s.output_ids) in joint for s in seqs) and p >= 1e-3 and df >= 4
    # rounds that began where the "c" is forced drafted it for free (others drafted across it)
    assert sum(run == [ord("c")] for run in runs) >= n // 10
    # an engine that masks every verified position as the first emits what the grammar refuses
    monkeypatch.setattr(round_module, "apply_grammar", _first_mask_everywhere)
    with pytest.raises(RuntimeError, match="grammar refused an emitted token"):
        run()
