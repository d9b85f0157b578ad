"""The 4-bit EAGLE-3 head (engine/drafters/eagle/q4.py): its matrices round to the nearest of 16
levels per group of 32, the fused projections split back in order, and an engine drafting with
it keeps greedy output equal to the target's alone."""

from __future__ import annotations

import torch

from engine.builder import head_runner
from engine.drafters.eagle.drafter import EagleDrafter
from engine.drafters.eagle.q4 import dequantize, quantize, supported
from engine.model.q4_matmul import GROUP, Q4Weight
from tests import helpers
from tests.eagle_builders import (
    HIDDEN,
    LAYERS,
    VOCAB,
    assert_greedy_ragged_equals_plain,
    eagle_engine,
    random_head,
)


def dequantized(w: torch.Tensor) -> torch.Tensor:
    """The matrix a :func:`quantize` of ``w`` stands for ``[out, in]``."""
    return dequantize(quantize(w, torch.bfloat16))


def test_each_weight_rounds_to_its_group_grid():
    """Every weight lands within half a step ((max - min) / 15 / 2 of its group, plus bf16
    rounding of the scales) of its value, and a group's extremes are kept."""
    w = torch.randn(48, 4 * GROUP, generator=torch.Generator().manual_seed(0)).bfloat16()
    deq, g = dequantized(w), w.float().reshape(48, 4, GROUP)
    step = (g.amax(-1) - g.amin(-1)) / 15  # [out, in/32]
    err = (deq.reshape(48, 4, GROUP) - g).abs()
    assert bool((err <= step[..., None] * 0.5 + 0.02 * g.abs().amax(-1, keepdim=True)).all())
    assert err.amax() > 0  # it did quantize
    torch.testing.assert_close(deq.reshape(48, 4, GROUP).amax(-1), g.amax(-1), atol=0.05, rtol=0.02)


def bf16_pair():
    """A bf16 tiny target and a head over all of its 16 tokens (widths the int4 kernel takes)."""
    target = helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN, sharpen=4.0)
    return target.to(torch.bfloat16), random_head(5, draft_vocab=VOCAB).to(torch.bfloat16)


def test_q4_head_computes_the_dense_head_on_its_rounded_weights():
    """The 4-bit head's forward equals the dense head's with every matrix replaced by its
    rounded value: Q, K, V and gate, up fused and split back in the right order."""
    target, head = bf16_pair()
    embed = target.model.embed_tokens
    dense_r = head_runner(head, embed, 2, 64)
    fc, layer, lm_head = dense_r.inputs.fc, dense_r.weights[0], head.lm_head.weight
    assert supported((fc, layer, lm_head), dense_r.device, dense_r.dtype)
    assert "+q4-" not in dense_r.path()
    rounded = head_runner(head, embed, 2, 64)
    with torch.no_grad():  # the dense head's matrices set to the 4-bit ones' values
        for m, src in [(head.fc.weight, fc), (head.lm_head.weight, lm_head)]:
            m.copy_(dequantized(src))
        for f in ("q", "k", "v", "o", "gate", "up", "down"):
            getattr(rounded.weights[0], f).copy_(dequantized(getattr(layer, f)))
    r4 = head_runner(bf16_pair()[1], embed, 2, 64, q4=True)
    assert isinstance(r4.inputs.fc, Q4Weight) and isinstance(r4.weights[0].qkv, Q4Weight)
    assert r4.path().startswith("eager+q4-")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, fc.shape[1], generator=g).bfloat16()
    ids = torch.randint(0, VOCAB, (2, 5), generator=g)
    outs = []
    for r in (r4, rounded):
        for s in (0, 1):
            r.cache.allocate(s)
        f = r.forward(ids, [0, 1], [5, 3], x=x)
        outs.append((f.output.float(), f.logits))
    (o4, l4), (o, lg) = outs
    torch.testing.assert_close(o4, o, atol=0.05, rtol=0.05)
    torch.testing.assert_close(l4, lg, atol=0.1, rtol=0.05)


def test_greedy_with_the_q4_head_equals_plain():
    """bf16 target, 4-bit head: ragged batches emit the plain engine's greedy output."""
    target, head = bf16_pair()
    engine = eagle_engine(target, head, slots=4, k=3, q4=True)  # as the builder: drafter.head_q4
    assert isinstance(engine.drafter, EagleDrafter) and engine.drafter.q4
    assert_greedy_ragged_equals_plain(engine, target, seed=5)


def test_float32_heads_stay_dense():
    """No fast int4 matmul with float32 activations: the head keeps its dense weights."""
    target = helpers.tiny_llama(3, layers=LAYERS, vocab=VOCAB, hidden=HIDDEN)
    head = random_head(5, draft_vocab=VOCAB)
    r = head_runner(head, target.model.embed_tokens, 1, 64, q4=True)
    assert not EagleDrafter(head, r, VOCAB).q4 and r.inputs.fc is head.fc.weight
    assert "+q4-" not in r.path()
