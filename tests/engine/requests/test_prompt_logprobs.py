"""engine/requests/prompt_logprobs.py: a scored prompt's log-probabilities equal the model's
own over the whole prompt, whatever the prefill chunking; max_tokens = 0 scores without
generating; asking for them changes nothing else."""

import pytest
import torch

from engine.records.params import SamplingParams, SpecParams
from tests.helpers import engine_for, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [5, 9, 2, 2, 7, 31, 8, 2, 40, 13, 9]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, layers=2, vocab=48, hidden=32, heads=2, kv_heads=1, max_positions=64)


@pytest.mark.parametrize("chunk", [3, 4, 64])
def test_scores_equal_the_models_own_whatever_the_chunking(model, chunk):
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1)  # [T, V]
    engine = engine_for(model, None, slots=2, chunk=chunk, max_len=32)
    seq = engine.add_request("r", PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=3))
    outs = []
    while engine.has_work():
        outs += engine.step()
    (out,) = outs
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert seq.output_ids == [] and engine.target.cache.used_tokens() == 0
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(PROMPT) and scores[0] is None
    for i in range(1, len(PROMPT)):
        lp = scores[i]
        assert lp is not None
        assert lp.logprob == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=1e-5)
        top = ref[i - 1].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)


def test_scoring_does_not_change_generation(model):
    def run(prompt_logprobs):
        engine = engine_for((model, model), "model", slots=2, chunk=4, max_len=32)
        p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        p2 = SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=prompt_logprobs
        )
        firsts = []
        seqs = engine.generate(
            [PROMPT, PROMPT[:5]],
            [p2, p],
            SpecParams(k=3),
            on_step=lambda outs: firsts.extend(o for o in outs if o.prompt_logprobs is not None),
        )
        return [s.output_ids for s in seqs], firsts

    plain, none = run(None)
    scored, firsts = run(0)
    assert plain == scored and none == []
    assert len(firsts) == 1 and len(firsts[0].prompt_logprobs) == len(PROMPT)
    assert all(lp.top == [] for lp in firsts[0].prompt_logprobs[1:])


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_a_cached_prompt_is_scored_whole(model, layout):
    """A prompt whose blocks are in the prefix cache (a request without scores cached them) is
    still scored at every position when a request asks for its logprobs: as many scores as
    prompt tokens, each the model's own, and the same output. Negative control: the blocks were
    there (a later request without scores starts on them)."""
    prompt = [(7 * i + 3) % 47 + 1 for i in range(40)]  # 2 full blocks of 16, and the rest
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # [T, V]
    engine = engine_for(model, None, slots=2, max_len=64, prefix_cache=64, kv_layout=layout)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (first,) = engine.generate([prompt], greedy)
    scored_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    sent: list = []
    (scored,) = engine.generate(
        [prompt],
        scored_params,
        on_step=lambda outs: sent.extend(o.prompt_logprobs for o in outs if o.prompt_logprobs),
    )
    (again,) = engine.generate([prompt], greedy)
    assert first.cached_tokens == 0 and again.cached_tokens == 32  # the cache held the prompt
    assert scored.output_ids == first.output_ids == again.output_ids
    (scores,) = sent
    assert len(scores) == len(prompt) and scores[0] is None
    got = torch.tensor([lp.logprob for lp in scores[1:]])
    torch.testing.assert_close(
        got, ref[torch.arange(39), torch.tensor(prompt[1:])], atol=1e-5, rtol=0
    )
    assert [[t for t, _ in lp.top] for lp in scores[1:]] == ref[:-1].topk(2).indices.tolist()
