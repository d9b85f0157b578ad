"""Stop conditions inside a round: tokens drafted past EOS / a stop id / max_tokens / the context
are never emitted (tiny random model drafting for itself, so whole rounds are accepted)."""

import pytest

from engine.records.params import SamplingParams, SpecParams
from tests import helpers

PROMPT = [5, 9, 13, 2, 7]


@pytest.fixture(scope="module")
def model():
    """Untied random weights: greedy output varies (a tied tiny model just repeats a token)."""
    return helpers.tiny_llama(3, layers=3, vocab=96, max_positions=256)


def make(model, max_len=64, eos=()):
    """The model drafting for itself, 2 slots."""
    return helpers.engine_for(model, "self", slots=2, max_len=max_len, eos=eos)


def plain(model, n):
    e = helpers.engine_for(model, None, slots=1, max_len=64)
    return e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n))[0].output_ids


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_exact_with_large_k(model, max_tokens):
    s = make(model).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens), SpecParams(k=6)
    )[0]
    assert s.output_ids == plain(model, max_tokens) and s.finish_reason == "length"


def test_stop_token_mid_round_cuts_the_round(model):
    ref = plain(model, 20)
    stop_at = next(i for i in range(3, 20) if ref[i] not in ref[:i])  # first occurrence at i
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(ref[stop_at],))
    s = make(model).generate([PROMPT], params, SpecParams(k=8))[0]
    assert s.output_ids == ref[: stop_at + 1] and s.finish_reason == "stop"
    assert s.drafted > len(s.output_ids) - 2  # the drafter did run past the stop


def test_eos_unless_ignored(model):
    ref = plain(model, 20)
    eos = ref[4] if ref[4] not in ref[:4] else ref[0]
    s = make(model, eos=[eos]).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20), SpecParams(k=8)
    )[0]
    assert s.output_ids[-1] == eos and s.output_ids == ref[: len(s.output_ids)]
    s = make(model, eos=[eos]).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), SpecParams(k=8)
    )[0]
    assert s.output_ids == ref


def test_context_length_ends_with_length(model):
    e = make(model, max_len=12)
    s = e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=50), SpecParams(k=5))[0]
    assert s.num_tokens == 12 and s.finish_reason == "length"
    assert s.output_ids == plain(model, 7)
    assert e.target.cache.used_tokens() == 0 and e.drafter.cache.used_tokens() == 0


def test_abort_frees_both_caches(model):
    e = make(model)
    e.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=30), SpecParams(k=3))
    e.step()
    e.step()
    assert e.target.cache.used_tokens() > 0 and e.drafter.cache.used_tokens() > 0
    assert e.abort("a") and not e.has_work()
    assert e.target.cache.used_tokens() == 0 and e.drafter.cache.used_tokens() == 0
    assert e.target.cache.num_free() == 2 and e.drafter.cache.num_free() == 2


@pytest.mark.parametrize("prompt", [[], [96], list(range(64))])
def test_bad_prompts_refused(model, prompt):
    with pytest.raises(ValueError):
        make(model).add_request("x", prompt, SamplingParams())
