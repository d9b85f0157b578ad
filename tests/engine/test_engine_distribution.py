"""End to end through the engine (prefill, draft model or n-gram, verify, accept, cache commit)
on tiny random models with an 8-token vocabulary: sampled output with speculation follows the
target's exact distribution, computed by enumeration."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.drafters import ModelDrafter, NgramDrafter
from engine.engine import SpecEngine
from engine.k_control import AdaptiveK, RoundCost
from engine.model_runner import ModelRunner
from engine.sampling import SamplingParams, logits_to_probs
from engine.sequence import SpecParams

V = 8


def tiny(seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharpen the output so distributions are far from uniform
        m.lm_head.weight.mul_(8.0)
    return m


def exact_joint(model, prompt, n_tokens, temperature, top_p):
    """P(t1..tn | prompt) for every outcome, by walking the tree of prefixes."""

    def probs(ids):
        with torch.no_grad():
            lg = model(torch.tensor([ids])).logits[:, -1:]
        return logits_to_probs(
            lg, torch.tensor([temperature]), torch.tensor([0]), torch.tensor([top_p])
        )[0, 0].tolist()

    joint = {}

    def walk(prefix, pr):
        if len(prefix) == n_tokens:
            joint[tuple(prefix)] = pr
            return
        for t, pt in enumerate(probs(prompt + prefix)):
            if pt > 0:
                walk(prefix + [t], pr * pt)

    walk([], 1.0)
    return joint


class SyntheticCost(RoundCost):
    """A made-up machine where each drafted token costs 10% of a round: K then moves with the
    requests' acceptance estimates."""

    def observe(self, *args):
        pass

    def predict(self, batch, width, steps):
        return 1.0 + 0.1 * width


def synthetic_adaptive():
    return AdaptiveK(4, cost=SyntheticCost())


@pytest.mark.parametrize(
    "drafter_kind,temperature,top_p,adaptive",
    [
        ("model", 1.0, 1.0, False),
        ("model", 0.8, 0.9, False),
        ("ngram", 1.0, 1.0, False),
        ("model", 1.0, 1.0, True),
        ("ngram", 0.8, 1.0, True),
    ],
)
def test_sampled_speculation_matches_target_distribution(
    drafter_kind, temperature, top_p, adaptive
):
    target = tiny(1)
    n_samples, n_tokens, k = 3000, 4, 2
    prompt = [1, 2, 3, 1, 2]  # repeats, so the n-gram drafter proposes
    tr = ModelRunner(target, num_slots=64, max_len=32)
    if drafter_kind == "model":
        drafter = ModelDrafter(ModelRunner(tiny(2), num_slots=64, max_len=32), V)
    else:
        drafter = NgramDrafter("cpu")
    controller = synthetic_adaptive() if adaptive else None
    engine = SpecEngine(
        tr, drafter, eos_token_ids=[], max_prefill_per_step=64, controller=controller
    )
    # adaptive K is for unseeded requests (seeded sampling pins K to reproduce)
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=n_tokens,
            seed=None if adaptive else i,
            ignore_eos=True,
        )
        for i in range(n_samples)
    ]
    ks = []
    seqs = engine.generate(
        [prompt] * n_samples,
        params,
        SpecParams() if adaptive else SpecParams(k=k),
        on_step=lambda outs: ks.extend(o.stats.k for o in outs if o.stats),
    )
    drafted = sum(s.drafted for s in seqs)
    accepted = sum(s.accepted for s in seqs)
    # both accept and reject paths ran (adaptive K drafts less where acceptance is low)
    assert drafted > (n_samples / 5 if adaptive else n_samples) and 0 < accepted < drafted
    if adaptive:
        assert len(set(ks)) >= 3  # K really varied from round to round
    joint = exact_joint(target, prompt, n_tokens, temperature, top_p)
    counts = {}
    for s in seqs:
        counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
    assert all(o in joint for o in counts), "an impossible sequence was emitted"
    # the joint of the first two tokens and the marginals of the 3rd and 4th, against exact values
    for keyf, size in [(lambda o: o[:2], 2), (lambda o: o[2:3], 1), (lambda o: o[3:], 1)]:
        p, h = {}, {}
        for o, pr in joint.items():
            p[keyf(o)] = p.get(keyf(o), 0.0) + pr
        for o, c in counts.items():
            h[keyf(o)] = h.get(keyf(o), 0) + c / n_samples
        tv = 0.5 * sum(abs(p[x] - h.get(x, 0.0)) for x in p)
        bound = 0.5 * sum(5 * (q * (1 - q) / n_samples) ** 0.5 for q in p.values())
        assert tv < bound, (size, tv, bound)
    assert engine.target.cache.used_tokens() == 0 and engine.target.cache.num_free() == 64
