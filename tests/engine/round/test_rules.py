"""engine/round/rules.py: allowed_token_ids, bad_words, min_tokens and min_p match their
definitions at every verified position (the drafts before a position counted as output), greedy
output with them is the same with speculation as without and as an independent reference decoder,
a min_tokens output runs past where it would have stopped, a bad word never comes where it came
without the rule, and sampled output with them follows the processed target's exact distribution
-- tests that reject an engine whose min_tokens or bad words ignore the drafts before each
position."""

import itertools
import math

import pytest
import torch

from engine.kcontrol.controller import may_grow
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import Sequence
from engine.round import speculator as round_module
from engine.round.rules import apply_rules
from tests.audit import RoundAudit, hf_reference
from tests.distribution import assert_fits, assert_rejects, exact_joint
from tests.helpers import assert_speculated, engine_for, sharp_tiny

pytestmark = pytest.mark.usefixtures("single_thread")

V = 8
PROMPT = [3, 7, 3, 3, 7]
EOS = (5,)


def tiny(seed):
    return sharp_tiny(seed, V)


def reference(logits: list[float], output: list[int], p: SamplingParams, eos=EOS) -> list[float]:
    """The rules' definitions, token by token (no tensors): allowed tokens, bad words (a word's
    last token out where the output ends with the rest of it; unless nothing else is left),
    min_tokens' masked stop tokens (unless nothing else is left), then min_p on the
    probabilities after the temperature."""
    ninf = -math.inf
    x = list(logits)
    if p.allowed_token_ids is not None:
        x = [v if j in p.allowed_token_ids else ninf for j, v in enumerate(x)]
    banned = {
        w[-1]
        for w in p.bad_words
        if len(w) - 1 <= len(output) and output[len(output) - (len(w) - 1) :] == list(w[:-1])
    }
    masked = [ninf if j in banned else v for j, v in enumerate(x)]
    if any(v > ninf for v in masked):
        x = masked
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
    if len(output) < p.min_tokens:
        masked = [ninf if j in stops else v for j, v in enumerate(x)]
        if any(v > ninf for v in masked):
            x = masked
    if p.min_p > 0 and p.temperature > 0:
        top = max(x)
        probs = [math.exp((v - top) / p.temperature) for v in x]  # relative to the top one's
        x = [ninf if q < p.min_p else v for v, q in zip(x, probs)]
    return x


def test_every_position_counts_the_drafts_before_it():
    torch.manual_seed(0)
    p = SamplingParams(
        temperature=0.8,
        min_p=0.2,
        min_tokens=5,
        stop_token_ids=(2,),
        allowed_token_ids=(0, 2, 3, 5, 6),
    )
    seq = Sequence("r", [2, 5, 5], p, SpecParams())
    seq.append([3, 6])
    drafts = [6, 0, 3, 7]
    logits = torch.randn(1, 5, V) * 3  # [1, K+1, V]
    got = apply_rules(logits, [seq], EOS)
    for i in range(5):
        want = reference(logits[0, i].tolist(), [3, 6] + drafts[:i], p)
        assert got[0, i].tolist() == pytest.approx(want, abs=1e-5), i
    # positions 0..2 may not stop (2 + i < 5): the stop token 2 and EOS 5 are out there only
    assert all(math.isinf(got[0, i, 2]) and math.isinf(got[0, i, 5]) for i in range(3))
    # a row without rules is left as it was, beside a ruled one; none ruled: the same tensor
    plain = Sequence("q", [1], SamplingParams(), SpecParams())
    both = apply_rules(torch.cat([logits, logits]), [seq, plain], EOS)
    assert torch.equal(both[1], logits[0]) and torch.equal(both[0], got[0])
    assert apply_rules(logits, [plain], EOS) is logits
    # greedy rows skip min_p (the argmax never falls below it), and a stop the only way out stays
    greedy = Sequence("g", [1], SamplingParams(temperature=0, min_p=0.9), SpecParams())
    assert apply_rules(logits, [greedy], EOS) is logits
    only_stop = SamplingParams(min_tokens=9, allowed_token_ids=(5,))
    cornered = Sequence("c", [1], only_stop, SpecParams())
    out = apply_rules(logits, [cornered], EOS)
    assert torch.isfinite(out[0, :, 5]).all() and out[0].isfinite().sum() == 5


def test_bad_words_at_every_position_count_the_drafts_before_it():
    """A word's last token is banned where the output so far, with the drafts before the
    position, ends with the rest of the word; the prompt does not count (vLLM's rule); a
    one-token word is banned everywhere; a ban that would leave nothing is not applied."""
    torch.manual_seed(1)
    words = ((4,), (6, 1), (3, 6, 2), (7, 7))
    p = SamplingParams(temperature=0.8, bad_words=words)
    seq = Sequence("r", [6, 3, 6], p, SpecParams())  # the prompt ends with 3, 6: not counted
    seq.append([3])
    drafts = [6, 1, 6, 7, 7]
    logits = torch.randn(1, 6, V) * 3
    got = apply_rules(logits, [seq], EOS, torch.tensor([drafts]))
    for i in range(6):
        want = reference(logits[0, i].tolist(), [3] + drafts[:i], p)
        assert got[0, i].tolist() == pytest.approx(want, abs=1e-5), i
    banned = [{j for j in range(V) if math.isinf(got[0, i, j])} for i in range(6)]
    # 4 everywhere; 2 after 3, 6 (position 1: output 3 + d_1 = 6); 1 after 6 (positions 1, 3);
    # 7 after 7 (positions 4, 5)
    assert banned == [{4}, {4, 1, 2}, {4}, {4, 1}, {4, 7}, {4, 7}]
    # the prompt alone (no output yet) bans only the one-token word
    fresh = Sequence("f", [3, 6], p, SpecParams())
    first = apply_rules(logits[:, :1], [fresh], EOS)
    assert {j for j in range(V) if math.isinf(first[0, 0, j])} == {4}
    # nothing else left (allowed_token_ids (4,)): the position is left as the allowed rule made it
    cornered = Sequence(
        "c", [1], SamplingParams(allowed_token_ids=(4,), bad_words=((4,),)), SpecParams()
    )
    out = apply_rules(logits[:, :1], [cornered], EOS)
    assert torch.isfinite(out[0, 0, 4]) and out[0, 0].isfinite().sum() == 1
    # a row with a multi-token word verifies chains only; one-token words may grow a tree
    assert not may_grow(seq)
    assert may_grow(Sequence("t", [1], SamplingParams(bad_words=((4,),)), SpecParams()))


def reference_greedy(model, prompt: list[int], p: SamplingParams, n: int) -> list[int]:
    """Greedy decoding by transformers' forward over the whole sequence each step (no cache),
    the rules by :func:`reference`, ending at a stop token as the engine does."""
    out: list[int] = []
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS))
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out], device=model.device)).logits[0, -1]
        x = reference(logits.float().tolist(), out, p)
        out.append(max(range(len(x)), key=x.__getitem__))
        if out[-1] in stops:
            break
    return out


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_with_rules_is_exact_under_speculation(drafter):
    models = tiny(1), tiny(2)
    prompts = [PROMPT, [1, 2, 1, 2, 1, 2], [0, 4, 4, 4], PROMPT]
    # where plain greedy decoding of each prompt would stop: its second token as a stop id
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain_engine = engine_for(models, None, slots=4, max_len=32, eos=EOS)
    early = [s.output_ids[1] for s in plain_engine.generate(prompts, [free] * 4)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(early[0],), min_tokens=8),
        SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=(1, 2, 4, 6)),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(early[2],), ignore_eos=True),
        SamplingParams(  # the control: where prompt 0 stops without min_tokens
            temperature=0, max_tokens=12, stop_token_ids=(early[0],), ignore_eos=True
        ),
    ]
    spec = engine_for(models, drafter, slots=4, max_len=32, eos=EOS).generate(
        prompts, params, SpecParams(k=4)
    )
    plain = engine_for(models, None, slots=4, max_len=32, eos=EOS).generate(prompts, params)
    for s, q, prompt, p in zip(spec, plain, prompts, params):
        assert s.output_ids == q.output_ids == reference_greedy(models[0], prompt, p, 12)
    assert_speculated(spec)  # both paths ran
    # the effects: a stop id ends the output at that id (the control stops at its second token,
    # where the stop id first comes); min_tokens runs past it; allowed tokens only
    assert spec[2].output_ids[-1] == early[2] and len(spec[2].output_ids) <= 2
    assert spec[2].finish_reason == "stop"
    assert len(spec[0].output_ids) >= 8 and len(spec[3].output_ids) <= 2
    assert set(spec[1].output_ids) <= {1, 2, 4, 6}


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_with_bad_words_is_exact_under_speculation(drafter):
    """Bad words taken from each prompt's plain greedy output (its first token; the pair at its
    third and fourth): with them, greedy output under speculation equals plain decoding and the
    reference decoder, and neither word comes again where it came without them. The draft
    model is the target itself: it proposes the raw argmax, the banned words among them, which
    the rule must reject (and accepts the rest)."""
    models = tiny(1), tiny(1)
    prompts = [PROMPT, [1, 2, 1, 2, 1, 2], [0, 4, 4, 4]]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain_engine = engine_for(models, None, slots=3, max_len=32, eos=EOS)
    control = [s.output_ids for s in plain_engine.generate(prompts, [free] * 3)]
    params = [
        SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, bad_words=((o[0],), (o[2], o[3]))
        )
        for o in control
    ]
    spec = engine_for(models, drafter, slots=3, max_len=32, eos=EOS).generate(
        prompts, params, SpecParams(k=4)
    )
    plain = engine_for(models, None, slots=3, max_len=32, eos=EOS).generate(prompts, params)
    for s, q, prompt, p, o in zip(spec, plain, prompts, params, control):
        assert s.output_ids == q.output_ids == reference_greedy(models[0], prompt, p, 12)
        out = s.output_ids
        assert o[0] not in out and out != o  # the one-token word never comes
        pairs = list(itertools.pairwise(out))
        assert (o[2], o[3]) not in pairs  # nor the second token of the pair after its first
    assert_speculated(spec)


def exact_joint_ruled(model, p: SamplingParams, n_tokens: int) -> dict:
    """P(output) of every output of at most ``n_tokens`` tokens, by the suite's enumerator, with
    the rules of :func:`reference` before the temperature."""

    def process(raw: torch.Tensor, output: list[int]) -> torch.Tensor:
        return torch.tensor(reference(raw.tolist(), output, p))

    stops = set(p.stop_token_ids) | set(EOS)
    return exact_joint(model, PROMPT, n_tokens, p.temperature, stop=stops, process=process)


def _ignoring_drafts(logits, seqs, eos, drafts=None):
    """Wrong: every verified position ruled as if no draft came before it."""
    cols = [apply_rules(logits[:, i : i + 1], seqs, eos) for i in range(logits.shape[1])]
    return torch.cat(cols, dim=1)


@pytest.mark.slow
def test_sampled_with_rules_follows_the_processed_distribution(monkeypatch):
    models = tiny(1), tiny(2)
    p = dict(temperature=1.0, max_tokens=5, min_p=0.08, min_tokens=2, stop_token_ids=(0,))
    joint = exact_joint_ruled(models[0], SamplingParams(**p), 5)
    n = 4000

    def run():
        engine = engine_for(
            models, "model", slots=1024, chunk=10**6, max_len=16, max_prefill=1024, eos=EOS
        )
        params = [SamplingParams(seed=i, **p) for i in range(n)]
        return engine.generate([PROMPT] * n, params, SpecParams(k=3))

    seqs = run()
    drafted, accepted = assert_speculated(seqs, min_drafted=n)
    assert 0.05 < accepted / drafted < 0.95
    outs = [s.output_ids for s in seqs]
    assert all(len(o) >= 2 for o in outs)  # min_tokens held
    assert any(len(o) < 5 for o in outs)  # and a stop still ends some after it
    assert_fits(outs, joint, "min_p + min_tokens + stop ids, draft model, T=1")
    # the test has the power to see a min_tokens that ignores the drafts before a position
    monkeypatch.setattr(round_module, "apply_rules", _ignoring_drafts)
    wrong = run()
    assert_rejects([s.output_ids for s in wrong], joint, "rules ignoring drafts")


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_every_min_p_round_is_what_it_should_be(drafter, monkeypatch):
    """The round audit (tests/audit.py) with min_p: the p the acceptance rule gets at every
    verified position is the reference's min-p-filtered distribution; no token below the
    threshold is ever emitted; a round that drops min_p fails the audit."""
    models = tiny(1), tiny(2)
    n, prompt = 32, [3, 7, 3, 3, 7, 1, 3, 7]

    def audited():
        engine = engine_for(models, drafter, slots=n, max_len=32, eos=EOS)
        audit = RoundAudit(engine, hf_reference(models[0]))
        ps = [
            SamplingParams(temperature=1.0, min_p=0.3, max_tokens=8, seed=i, ignore_eos=True)
            for i in range(n)
        ]
        return audit, engine.generate([prompt] * n, ps, SpecParams(k=4))

    audit, seqs = audited()
    audit.assert_clean()
    assert audit.skipped == 0
    assert_speculated(seqs)
    for s in seqs:  # every emitted token was at least min_p x the most probable one
        for i, t in enumerate(s.output_ids):
            with torch.no_grad():
                ids = torch.tensor([prompt + s.output_ids[:i]])
                probs = torch.softmax(models[0](ids).logits[0, -1].double(), -1)
            assert probs[t] >= 0.3 * probs.max() - 1e-6
    # the control: min_p not applied in the round fails the audit
    monkeypatch.setattr(round_module, "apply_rules", lambda logits, seqs, eos, drafts: logits)
    wrong, _ = audited()
    assert wrong.failures
