"""engine/sampling/grammar.py: grammar-constrained output under speculation, over a tiny random
model whose vocabulary is llguidance's byte tokenizer. Greedy output with speculation equals it
without (and matches the grammar); sampled output follows the masked target's exact
distribution (with the token the grammar forces drafted for free, forced.py), by a chi-square
test that rejects an engine masking every verified position as the first (ignoring the drafts
before it)."""

import re

import pytest
import torch

from engine.drafters.forced import forced_run
from engine.records.params import SamplingParams, SpecParams
from engine.round import speculator as round_module
from engine.sampling.grammar import apply_grammar
from tests.distribution import assert_fits, exact_joint
from tests.eagle_builders import random_head
from tests.grammar_builders import engine, text
from tests.helpers import assert_speculated, tiny_llama

llguidance = pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("single_thread")

PATTERN = r"[ab]{2}c[ab]"
PROMPT = [ord(c) for c in "abcab"]


GRAMMAR = llguidance.LLMatcher.grammar_from_regex(PATTERN)


LONG = r"[ab]{8}c[ab]{3}"  # long runs of a / b: drafts that the target keeps and rejects


def byte_eagle(byte_tok):
    """A 3-layer byte model (an EAGLE-3 head taps three distinct layers) and a random head over
    it, its draft vocabulary 64 of the bytes."""
    make = dict(vocab=byte_tok.vocab_size, hidden=32, heads=2, kv_heads=1, max_positions=64)
    target = tiny_llama(13, layers=3, sharpen=6.0, **make)
    return target, random_head(4, vocab=byte_tok.vocab_size, draft_vocab=64, layers=3, hidden=32)


@pytest.mark.parametrize(
    "drafter",
    ["model", "layers", "ngram", "eagle3", "eagle3+ngram"],
)
def test_greedy_under_a_grammar_equals_plain_and_matches(byte_models, byte_tok, drafter):
    """Rows under a grammar beside free rows, greedy: the same output as plain decoding, the
    grammar matched, and the drafter's proposals (masked by the grammar) both kept and
    rejected."""
    grammar = llguidance.LLMatcher.grammar_from_regex(LONG)
    prompts = [[ord(c) for c in p] for p in ("abcab", "aabba", "babab", "bbaab", "abab")]
    params = [SamplingParams(temperature=0, max_tokens=12, grammar=grammar)] * len(prompts)
    params += [SamplingParams(temperature=0, max_tokens=12)]  # a free row beside them
    prompts += [PROMPT]
    kw = {"layers": {"num_layers": 1}}.get(drafter, {})
    models = byte_models
    if drafter.startswith("eagle3"):
        models, kw["head"] = byte_eagle(byte_tok)
    e = engine(models, byte_tok, drafter, slots=8, max_len=32, **kw)
    spec = e.generate(prompts, params, SpecParams(k=3))
    plain = engine(models, byte_tok, None, slots=8, max_len=32).generate(prompts, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    # the random one-layer draft model and head never agree with the target here: rejected only
    assert_speculated(spec[:-1], can_reject=drafter in ("layers", "ngram", "eagle3+ngram"))
    assert all(re.fullmatch(LONG, text(s.output_ids)) for s in spec[:-1])
    assert not re.fullmatch(LONG, text(spec[-1].output_ids))  # the model alone would not


def exact_joint_masked(model, byte_tok, temperature: float) -> dict:
    """P(output) of every output the grammar allows, by the suite's enumerator over the masked
    target."""

    def mask(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        m = llguidance.LLMatcher(byte_tok, GRAMMAR)
        assert m.consume_tokens(output)
        allowed = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8) > 0
        return logits.masked_fill(~allowed[: logits.shape[0]], float("-inf"))

    return exact_joint(model, PROMPT, 4, temperature, process=mask)


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
    drafted, accepted = assert_speculated(seqs, min_drafted=n)
    assert 0.05 < accepted / drafted < 0.95
    assert_fits([s.output_ids for s in seqs], joint, "grammar, draft model, T=1", min_df=4)
    # rounds that began where the "c" is forced drafted it for free (others drafted across it)
    assert sum(run == [ord("c")] for run in runs) >= n // 10
    # an engine that masks every verified position as the first emits what the grammar refuses
    monkeypatch.setattr(round_module, "apply_grammar", _first_mask_everywhere)
    with pytest.raises(RuntimeError, match="grammar refused an emitted token"):
        run()


@pytest.mark.parametrize("drafter", ["self", "ngram"])
def test_a_grammar_finished_mid_round_ends_at_its_eos(byte_models, byte_tok, drafter):
    """The drafter proposes the grammar's last token and then the EOS after it in one round
    (the target drafting for itself; an n-gram copy of a finished match). The finished matcher
    takes nothing more (an EOS fed to it errs it for good, and its mask then refuses the right
    tokens of later rounds): the output is the grammar's match, ended by the EOS."""
    eos = byte_tok.eos_token
    grammar = llguidance.LLMatcher.grammar_from_regex(r"[ab]{3}")  # nothing forced
    prompt = [ord(c) for c in "abb"] + [eos] + [ord(c) for c in "abb"] + [eos] + [ord("x")]
    params = [SamplingParams(temperature=0, max_tokens=8, grammar=grammar)] * 3
    e = engine(byte_models, byte_tok, drafter, slots=4, max_len=32, eos=[eos])
    spec = e.generate([prompt] * 3, params, SpecParams(k=4))
    plain = engine(byte_models, byte_tok, None, slots=4, max_len=32, eos=[eos])
    want = plain.generate([prompt] * 3, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in want]
    assert all(re.fullmatch("[ab]{3}", text(s.output_ids[:-1])) for s in spec)
    assert all(s.output_ids[-1] == eos for s in spec)
    assert all(s.finish_reason == "stop" for s in spec)
    assert_speculated(spec, can_reject=False)
