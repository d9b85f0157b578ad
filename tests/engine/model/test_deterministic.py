"""Deterministic mode end to end (engine/model/invariant.py through SpecEngine): with
batch-invariant forwards, greedy output and seeded output (K = 0) are the same alone or in any batch
and with speculation on or off, in bf16; "request" mode makes a request that asks deterministic
whatever shares its batch; an engine with the mode off refuses such a request.

A request's output here is its tokens and the log-probability of each (``logprobs=0``): bits
that any rounding difference of the target's logits changes. Each claim has its control: with
the mode off (or, in "request" mode, a request that does not ask), the same requests give a
different output in those batches -- the plain bf16 forward is not batch-invariant at these
shapes (hidden size 256: on a 2-core Xeon a batch changed even greedy tokens there, not only
log-probabilities; at 64 it changed log-probabilities only) -- and the target's forwards are
counted: every one is the invariant forward with the mode on, none with it off. On the real
SmolLM2 in bf16 (slow) the same holds token for token, with the same control. The controls run
attention on torch's SDPA: on specd's CPU attention kernel (engine/model/attention.py) the plain
forward of these shapes can be batch-invariant too, and a control would prove nothing."""

import contextlib

import pytest
import torch

from engine.model import attention
from engine.records.params import SamplingParams, SpecParams
from tests.helpers import assert_speculated, engine_for, tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
REPEATS = [[5, 6, 7] * 3, [9, 3, 9, 3, 9, 3, 9]]  # the n-gram drafter proposes


@pytest.fixture(scope="module")
def bf16_target():
    """A sharpened 3-layer target in bf16, hidden size 256 (see the module's docstring)."""
    return tiny_llama(21, layers=3, vocab=64, hidden=256, sharpen=4.0).to(torch.bfloat16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in (4, 11, 23, 40)]
    return ps + [[5, 6, 7, 5, 6, 7, 5, 6]]  # a repeat: the n-gram drafter proposes


@pytest.fixture(autouse=True)
def sdpa_when_off(request):
    """A test of mode "off" (a control) runs its forwards' attention on torch's SDPA."""
    callspec = getattr(request.node, "callspec", None)
    off = callspec is not None and callspec.params.get("mode") == "off"
    with attention.only_sdpa() if off else contextlib.nullcontext():
        yield


def engine(target, drafter, mode="always", slots=8):
    """``drafter`` "layers": a draft model, the target's first 2 layers (it agrees with the
    target at times, unlike an unrelated random model)."""
    e = engine_for(target, drafter, slots=slots, chunk=16, max_len=128, num_layers=2)
    e.deterministic = mode
    return e


def run(e, prompts, params, spec=None):
    """Each request's output: (token ids, log-probabilities of those tokens); and the
    sequences."""
    logprobs: dict[str, list[float]] = {}

    def keep(outs):
        for o in outs:
            logprobs.setdefault(o.request_id, []).extend(o.logprobs or [])

    seqs = e.generate(prompts, params, spec, on_step=keep)
    return [(s.output_ids, logprobs.get(s.request_id, [])) for s in seqs], seqs


def same(mode: str, got, alone) -> None:
    """With the mode on, ``got`` is ``alone`` exactly; off, the control: some output differs."""
    if mode == "off":
        assert got != alone, (
            "the plain bf16 forward was batch-invariant: these shapes prove nothing"
        )
    else:
        assert got == alone


@pytest.mark.parametrize("mode", ["always", "off"])
@pytest.mark.parametrize("drafter", ["ngram", "layers"])
def test_greedy_is_the_same_alone_batched_and_speculating(
    bf16_target, prompts, drafter, mode, invariant_calls
):
    alone = [run(engine(bf16_target, None, mode), [p], GREEDY)[0][0] for p in prompts]
    batched, _ = run(engine(bf16_target, None, mode), prompts, GREEDY)
    spec, seqs = run(engine(bf16_target, drafter, mode), prompts, GREEDY, SpecParams(k=3))
    assert_speculated(seqs)
    same(mode, batched, alone)
    same(mode, spec, alone)
    assert bool(invariant_calls) == (mode != "off")


@pytest.mark.parametrize("mode", ["always", "off"])
def test_seeded_sampling_is_the_same_alone_and_batched(bf16_target, prompts, mode, invariant_calls):
    """Seeded rows at K = 0, alone and in a batch beside greedy rows that speculate (the
    n-gram drafter at K = 3: verify forwards of 4 tokens a row)."""
    params = [
        SamplingParams(temperature=0.9, seed=40 + i, max_tokens=20, logprobs=0) for i in range(5)
    ]
    alone = [
        run(engine(bf16_target, None, mode), [p], [sp])[0][0] for p, sp in zip(prompts, params)
    ]
    e = engine(bf16_target, "ngram", mode)
    spec = [SpecParams(enabled=False)] * len(prompts) + [SpecParams(k=3)] * len(REPEATS)
    got, seqs = run(e, prompts + REPEATS, params + [GREEDY] * len(REPEATS), spec)
    assert sum(s.drafted for s in seqs[: len(prompts)]) == 0
    assert_speculated(seqs[len(prompts) :])
    same(mode, got[: len(prompts)], alone)
    assert bool(invariant_calls) == (mode != "off")


def test_request_mode_holds_a_deterministic_request_whatever_shares_its_batch(bf16_target, prompts):
    det = SamplingParams(temperature=0, max_tokens=24, logprobs=0, deterministic=True)
    spec = SpecParams(k=3)
    alone = run(engine(bf16_target, "ngram", "request"), [prompts[2]], det, spec)[0][0]
    mixed = [GREEDY, GREEDY, det, GREEDY, GREEDY]
    got, seqs = run(engine(bf16_target, "ngram", "request"), prompts, mixed, spec)
    assert got[2] == alone
    assert_speculated(seqs)
    # the control: the same request not asking runs the plain forward in that batch
    got, _ = run(engine(bf16_target, "ngram", "request"), prompts, GREEDY, spec)
    assert got[2] != alone


def test_an_engine_with_the_mode_off_refuses_a_deterministic_request(bf16_target):
    e = engine(bf16_target, None, "off")
    with pytest.raises(ValueError, match="deterministic mode is off"):
        e.add_request("r", [1, 2], SamplingParams(max_tokens=2, deterministic=True))


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_bf16_greedy_is_the_same_alone_batched_and_speculating():
    """The real SmolLM2 in bf16: with the mode off a batch changes the output (the control);
    with it on, alone, batched and speculating (n-gram, K = 4; a counting completion that it
    copies) give the same tokens and log-probabilities."""
    from engine.model.loader import load_model
    from prompts.sets import Prompt, encode, human_eval, mt_bench
    from tests.conftest import REAL_SPEC

    model, tok = load_model(REAL_SPEC, "bfloat16")
    chosen = mt_bench()[:2] + human_eval()[:1]
    chosen.append(Prompt("count", "test", "completion", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"))
    prompts = [encode(tok, p) for p in chosen]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=0)

    def run_real(mode, drafter, ps, spec=None):
        e = engine_for(model, drafter, slots=8, max_len=1024)
        e.deterministic = mode
        return run(e, ps, params, spec)

    for mode in ("off", "always"):
        alone = [run_real(mode, None, [p])[0][0] for p in prompts]
        same(mode, run_real(mode, None, prompts)[0], alone)
    spec, seqs = run_real("always", "ngram", prompts, SpecParams(k=4))
    assert spec == alone
    assert_speculated(seqs)
