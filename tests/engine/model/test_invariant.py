"""engine/model/invariant.py: the batch-invariant forward of deterministic mode. A token's logits
are bit-identical however it is fed (one chunk, one token a forward, a verify of several, beside
other rows at other positions), in bf16 as in fp32, and equal the eager forward's up to
rounding; the start-up check passes on such kernels and names a forward that is not invariant.
The control: the eager forward of these very shapes is not bit-identical (in fp32 as in bf16),
and every forward of the test ran the invariant one (counted). The engine level (speculation on
or off, any batch, "request" mode) is test_deterministic.py."""

import pytest
import torch

from engine.model import attention, invariant
from engine.model.runner import ModelRunner
from tests.helpers import tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = list(range(3, 80))  # 77 tokens: TILE blocks and a part, attention past one SPAN


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def runner(request):
    m = tiny_llama(5, vocab=300, hidden=64, heads=4, kv_heads=2, layers=2, max_positions=256)
    return ModelRunner(m.to(request.param), num_slots=4, max_len=128)


def feed(
    r: ModelRunner, slot: int, pieces: list[int], beside: list[list[int]] = (), inv: bool = True
):
    """The prompt's logits fed in ``pieces`` (sizes) to ``slot``, other slots' rows beside it
    (fed at their start each time, never committed); ``inv``: by the invariant forward."""
    r.cache.free(slot)
    r.cache.allocate(slot)
    out, at = [], 0
    others = [s for s in range(4) if s != slot][: len(beside)]
    for n in pieces:
        rows = [PROMPT[at : at + n], *beside]
        logits = r.forward(rows, [slot, *others], logits="all", invariant=inv).logits
        out.append(logits[0, :n])
        at += n
        r.cache.commit(slot, at)
    return torch.cat(out)  # [prompt, vocab]


def fed_three_ways(runner: ModelRunner, inv: bool = True) -> list[torch.Tensor]:
    """The prompt's logits fed as one chunk, one token a forward beside two other rows, and in
    verify-like pieces beside a prefill-like row."""
    return [
        feed(runner, 0, [len(PROMPT)], inv=inv),
        feed(runner, 1, [1] * len(PROMPT), beside=[[7, 8, 9], [4]], inv=inv),
        feed(runner, 2, [5, 4, 1, 7, 20, 40], beside=[list(range(30, 52))], inv=inv),
    ]


def test_logits_are_bit_identical_however_the_tokens_are_fed(runner, invariant_calls):
    whole, one_by_one, verify_like = fed_three_ways(runner)
    assert torch.equal(one_by_one, whole) and torch.equal(verify_like, whole)
    assert len(invariant_calls) == 1 + len(PROMPT) + 6  # every forward was the invariant one
    # the control: the eager forward on torch's SDPA, fed the same ways, is not bit-identical
    # here (on specd's attention kernel it may be: engine/model/attention.py)
    with attention.only_sdpa():
        whole, one_by_one, verify_like = fed_three_ways(runner, inv=False)
    assert len(invariant_calls) == 1 + len(PROMPT) + 6  # (none of these ran it)
    assert not (torch.equal(one_by_one, whole) and torch.equal(verify_like, whole))


def test_invariant_forward_equals_the_eager_one_up_to_rounding(runner):
    inv = feed(runner, 0, [len(PROMPT)]).float()
    eager = feed(runner, 0, [len(PROMPT)], inv=False).float()
    tol = 1e-4 if runner.dtype == torch.float32 else 0.1
    assert (inv - eager).abs().max() < tol * eager.abs().max()
    assert torch.equal(inv.argmax(-1), eager.argmax(-1)) or runner.dtype == torch.bfloat16


def test_last_and_hidden_modes_pick_the_same_rows(runner):
    runner.cache.free(0)
    runner.cache.allocate(0)
    rows = [PROMPT[:9], PROMPT[:3]]
    runner.cache.free(1)
    runner.cache.allocate(1)
    every = runner.forward(rows, [0, 1], logits="all", invariant=True).logits  # [2, 9, vocab]
    last = runner.forward(rows, [0, 1], logits="last", invariant=True).logits  # [2, vocab]
    assert torch.equal(last[0], every[0, 8]) and torch.equal(last[1], every[1, 2])
    hidden = runner.hidden(rows, [0, 1], invariant=True).states  # [2, 9, hidden]
    assert hidden.shape == (2, 9, 64) and torch.equal(hidden[1, 3:], torch.zeros(6, 64))


def test_check_passes_here_and_names_a_forward_that_is_not_invariant(runner, monkeypatch):
    for s in range(4):
        runner.cache.free(s)
    invariant.check(runner)
    assert runner.cache.num_free() == 4  # slots given back
    logits = runner.logits  # a head whose result depends on how many rows it is given
    monkeypatch.setattr(runner, "logits", lambda h: logits(h) + 1e-3 * h.shape[0])
    monkeypatch.setattr(invariant, "TILE", 1)  # no padding, and one call for every row
    monkeypatch.setattr(invariant, "tiled", lambda fn, x: fn(x))
    with pytest.raises(RuntimeError, match="not batch-invariant"):
        invariant.check(runner)
