"""engine/round/penalties.py: logit bias and penalties match their formulas at every verified
position, greedy output with them is the same with speculation as without (and as an independent
reference decoder), and sampled output with them follows the processed target's exact
distribution -- a test that rejects an engine whose penalties ignore the drafts before each
position."""

import pytest
import torch

from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import Sequence
from engine.round import speculator as round_module
from engine.round.penalties import apply_penalties
from tests.distribution import assert_fits, assert_rejects, exact_joint
from tests.helpers import assert_speculated, engine_for, sharp_tiny

pytestmark = pytest.mark.usefixtures("single_thread")

V = 8
PROMPT = [3, 7, 3, 3, 7]


def tiny(seed):
    """The distribution tests' tiny Llama (vocabulary 8, LM head sharpened x8)."""
    return sharp_tiny(seed, V)


def outputs(seqs):
    return [s.output_ids for s in seqs]


STRONG = dict(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.6)
BIAS = ((1, 2.5), (4, -1.0))


def reference(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """The formulas, token by token (no tensors): OpenAI's bias and penalties and the
    CTRL repetition penalty over prompt + output."""
    bias = dict(p.logit_bias)
    out = []
    for j, raw in enumerate(logits):
        c, x = output.count(j), raw
        if p.repetition_penalty != 1.0 and (c > 0 or j in prompt):
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x = x - c * p.frequency_penalty - (c > 0) * p.presence_penalty
        out.append(x + bias.get(j, 0.0))
    return out


def test_every_position_counts_the_drafts_before_it():
    torch.manual_seed(0)
    p = SamplingParams(max_tokens=20, logit_bias=BIAS, **STRONG)
    seq = Sequence("r", [2, 5, 5], p, SpecParams())
    seq.append([3, 3, 6])
    drafts = torch.tensor([[6, 0, 3, 7]])  # [1, K]
    logits = torch.randn(1, 5, V) * 3  # [1, K+1, V]
    got = apply_penalties(logits, [seq], drafts)
    for i in range(5):
        want = reference(logits[0, i].tolist(), [2, 5, 5], [3, 3, 6] + drafts[0, :i].tolist(), p)
        assert got[0, i].tolist() == pytest.approx(want, abs=1e-5), i
    # a row without processing is left as it was, beside a processed one
    plain = Sequence("q", [1], SamplingParams(), SpecParams())
    both = apply_penalties(torch.cat([logits, logits]), [seq, plain], torch.cat([drafts, drafts]))
    assert torch.equal(both[1], logits[0]) and torch.equal(both[0], got[0])
    assert apply_penalties(logits, [plain], drafts) is logits


def reference_greedy(model, prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    """Greedy decoding by transformers' forward over the whole sequence each step (no cache),
    the processing by :func:`reference`."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out], device=model.device)).logits[0, -1]
            logits = logits.float().tolist()
        x = reference(logits, prompt, out, p)
        out.append(max(range(len(x)), key=x.__getitem__))
    return out


@pytest.mark.parametrize("drafter", ["model", "self", "ngram"])
def test_greedy_with_penalties_is_exact_under_speculation(drafter):
    models = tiny(1), tiny(2)
    prompts = [PROMPT, [1, 2, 1, 2, 1, 2], [0, 4, 4, 4]]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **STRONG),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=BIAS),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    spec_engine = engine_for(models, drafter, slots=4, max_len=32)
    spec = spec_engine.generate(prompts, params, SpecParams(k=4))
    plain = engine_for(models, None, slots=4, max_len=32).generate(prompts, params)
    for s, q, prompt, p in zip(spec, plain, prompts, params):
        assert s.output_ids == q.output_ids == reference_greedy(models[0], prompt, p, 12)
    assert_speculated(spec)  # both paths ran


def exact_joint_penalized(model, p: SamplingParams, n_tokens: int) -> dict:
    """P(output) of every output of ``n_tokens`` tokens, by the suite's enumerator, with the
    processing of :func:`reference` before the temperature."""

    def process(raw: torch.Tensor, output: list[int]) -> torch.Tensor:
        return torch.tensor(reference(raw.tolist(), PROMPT, output, p))

    return exact_joint(model, PROMPT, n_tokens, p.temperature, process=process)


def _ignoring_drafts(logits, seqs, drafts):
    """Wrong: every verified position processed as if no draft came before it."""
    none = drafts[:, :0]
    cols = [apply_penalties(logits[:, i : i + 1], seqs, none) for i in range(logits.shape[1])]
    return torch.cat(cols, dim=1)


@pytest.mark.slow
def test_sampled_with_penalties_follows_the_processed_distribution(monkeypatch):
    models = tiny(1), tiny(2)
    p = dict(temperature=1.0, max_tokens=4, ignore_eos=True, logit_bias=BIAS)
    p |= dict(presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=1.6)
    joint = exact_joint_penalized(models[0], SamplingParams(**p), 4)
    n = 4000

    def run():
        engine = engine_for(models, "model", slots=1024, chunk=10**6, max_len=16, max_prefill=1024)
        params = [SamplingParams(seed=i, **p) for i in range(n)]
        return engine.generate([PROMPT] * n, params, SpecParams(k=2))

    seqs = run()
    drafted, accepted = assert_speculated(seqs, min_drafted=n)
    assert 0.05 < accepted / drafted < 0.95
    assert_fits(outputs(seqs), joint, "penalties + bias, draft model, T=1")
    # the test has the power to see penalties that ignore the drafts before a position
    monkeypatch.setattr(round_module, "apply_penalties", _ignoring_drafts)
    wrong = run()
    assert_rejects(outputs(wrong), joint, "penalties ignoring drafts")
