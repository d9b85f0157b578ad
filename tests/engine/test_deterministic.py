"""Deterministic mode end to end (engine/invariant.py through SpecEngine): with batch-invariant
forwards, greedy output and seeded output (K = 0) are the same alone or in any batch and with
speculation on or off, in bf16; "request" mode makes a request that asks deterministic whatever
shares its batch; an engine with the mode off refuses such a request. On the real SmolLM2 in
bf16 (slow), where the default forward is not invariant (loadtest/bench/deterministic.py counts
how often it differs), the same holds token for token."""

import pytest
import torch

from engine.sampling import SamplingParams
from engine.sequence import SpecParams
from tests.helpers import engine_for, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def bf16_models():
    target = tiny_llama(21, layers=3, vocab=64, sharpen=4.0).to(torch.bfloat16)
    return target, tiny_llama(22, layers=1, vocab=64).to(torch.bfloat16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in (4, 11, 23, 40)]
    return ps + [[5, 6, 7, 5, 6, 7, 5, 6]]  # a repeat: the n-gram drafter proposes


def engine(models, drafter, mode="always", slots=8):
    e = engine_for(models, drafter, slots=slots, chunk=16, max_len=128)
    e.deterministic = mode
    return e


def outputs(e, prompts, params, spec=None) -> list[list[int]]:
    return [s.output_ids for s in e.generate(prompts, params, spec)]


GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_greedy_is_the_same_alone_batched_and_speculating(bf16_models, prompts, drafter):
    alone = [outputs(engine(bf16_models, None), [p], GREEDY)[0] for p in prompts]
    assert outputs(engine(bf16_models, None), prompts, GREEDY) == alone
    seqs = engine(bf16_models, drafter).generate(prompts, GREEDY, SpecParams(k=3))
    assert [s.output_ids for s in seqs] == alone
    assert sum(s.drafted for s in seqs) > 0


def test_seeded_sampling_is_the_same_alone_and_batched(bf16_models, prompts):
    params = [SamplingParams(temperature=0.9, seed=40 + i, max_tokens=20) for i in range(5)]
    alone = [outputs(engine(bf16_models, "model"), [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert outputs(engine(bf16_models, "model"), prompts, params) == alone
    assert outputs(engine(bf16_models, None), prompts, params) == alone  # speculation off


def test_request_mode_holds_a_deterministic_request_whatever_shares_its_batch(bf16_models, prompts):
    det = SamplingParams(temperature=0, max_tokens=24, deterministic=True)
    alone = outputs(engine(bf16_models, "ngram", "request"), [prompts[2]], det)[0]
    e = engine(bf16_models, "ngram", "request")
    mixed = [GREEDY, GREEDY, det, GREEDY, GREEDY]
    assert outputs(e, prompts, mixed, SpecParams(k=3))[2] == alone


def test_an_engine_with_the_mode_off_refuses_a_deterministic_request(bf16_models):
    e = engine(bf16_models, None, "off")
    with pytest.raises(ValueError, match="deterministic mode is off"):
        e.add_request("r", [1, 2], SamplingParams(max_tokens=2, deterministic=True))


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_bf16_greedy_is_the_same_alone_batched_and_speculating():
    from engine.loader import load_model
    from loadtest.datasets import encode, human_eval, mt_bench
    from tests.conftest import REAL_SPEC

    model, tok = load_model(REAL_SPEC, "bfloat16")
    chosen = mt_bench()[:2] + human_eval()[:1]
    prompts = [encode(tok, p) for p in chosen]
    params = SamplingParams(temperature=0, max_tokens=20)

    def run(drafter, ps, spec=None):
        e = engine_for(model, drafter, slots=8, max_len=1024)
        e.deterministic = "always"
        return [s.output_ids for s in e.generate(ps, params, spec)]

    alone = [run(None, [p])[0] for p in prompts]
    assert run(None, prompts) == alone
    assert run("ngram", prompts, SpecParams(k=4)) == alone
