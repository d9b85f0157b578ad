"""Stop conditions inside a round: tokens drafted past EOS / a stop id / max_tokens / the context
are never emitted (tiny random model drafting for itself, so whole rounds are accepted)."""

import pytest

from engine.drafters import ModelDrafter
from engine.engine import SpecEngine
from engine.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.sequence import SpecParams

PROMPT = [5, 9, 13, 2, 7]


@pytest.fixture(scope="module")
def tiny_llama():
    """Untied random weights: greedy output varies (a tied tiny model just repeats a token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def make(tiny_llama, max_len=64, eos=()):
    target = ModelRunner(tiny_llama, num_slots=2, max_len=max_len)
    draft = ModelDrafter(ModelRunner(tiny_llama, num_slots=2, max_len=max_len), target.vocab_size)
    return SpecEngine(target, draft, eos_token_ids=list(eos))


def plain(tiny_llama, n):
    e = SpecEngine(ModelRunner(tiny_llama, 1, 64), None, [])
    return e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n))[0].output_ids


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_exact_with_large_k(tiny_llama, max_tokens):
    s = make(tiny_llama).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens), SpecParams(k=6)
    )[0]
    assert s.output_ids == plain(tiny_llama, max_tokens) and s.finish_reason == "length"


def test_stop_token_mid_round_cuts_the_round(tiny_llama):
    ref = plain(tiny_llama, 20)
    stop_at = next(i for i in range(3, 20) if ref[i] not in ref[:i])  # first occurrence at i
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(ref[stop_at],))
    s = make(tiny_llama).generate([PROMPT], params, SpecParams(k=8))[0]
    assert s.output_ids == ref[: stop_at + 1] and s.finish_reason == "stop"
    assert s.drafted > len(s.output_ids) - 2  # the drafter did run past the stop


def test_eos_unless_ignored(tiny_llama):
    ref = plain(tiny_llama, 20)
    eos = ref[4] if ref[4] not in ref[:4] else ref[0]
    s = make(tiny_llama, eos=[eos]).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20), SpecParams(k=8)
    )[0]
    assert s.output_ids[-1] == eos and s.output_ids == ref[: len(s.output_ids)]
    s = make(tiny_llama, eos=[eos]).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), SpecParams(k=8)
    )[0]
    assert s.output_ids == ref


def test_context_length_ends_with_length(tiny_llama):
    e = make(tiny_llama, max_len=12)
    s = e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=50), SpecParams(k=5))[0]
    assert s.num_tokens == 12 and s.finish_reason == "length"
    assert s.output_ids == plain(tiny_llama, 7)
    assert e.target.cache.used_tokens() == 0 and e.drafter.cache.used_tokens() == 0


def test_abort_frees_both_caches(tiny_llama):
    e = make(tiny_llama)
    e.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=30), SpecParams(k=3))
    e.step()
    e.step()
    assert e.target.cache.used_tokens() > 0 and e.drafter.cache.used_tokens() > 0
    assert e.abort("a") and not e.has_work()
    assert e.target.cache.used_tokens() == 0 and e.drafter.cache.used_tokens() == 0
    assert e.target.cache.num_free() == 2 and e.drafter.cache.num_free() == 2


@pytest.mark.parametrize("prompt", [[], [96], list(range(64))])
def test_bad_prompts_refused(tiny_llama, prompt):
    with pytest.raises(ValueError):
        make(tiny_llama).add_request("x", prompt, SamplingParams())
