"""Our ragged forward over the slot cache against transformers' own forward (tiny random Llama)."""

import pytest
import torch

from engine.model.runner import ModelRunner, UnsupportedModelError


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0]


def test_full_prefill_matches_transformers(tiny_llama):
    r = ModelRunner(tiny_llama, num_slots=2, max_len=64)
    ids = list(range(3, 40))
    s = r.cache.allocate()
    out = r.forward([ids], [s], logits="all").logits[0]
    assert torch.allclose(out, hf_logits(tiny_llama, ids), atol=1e-5)


def test_incremental_and_ragged_rows_match(tiny_llama):
    r = ModelRunner(tiny_llama, num_slots=3, max_len=64)
    a, b, c = list(range(5, 25)), list(range(30, 37)), [9, 8, 7]
    ref = {0: hf_logits(tiny_llama, a), 1: hf_logits(tiny_llama, b), 2: hf_logits(tiny_llama, c)}
    slots = [r.cache.allocate() for _ in range(3)]
    # first feed different prefixes, then ragged continuations in one batch
    r.forward([a[:12], b[:2], c[:1]], slots)
    for s, n in zip(slots, [12, 2, 1]):
        r.cache.commit(s, n)
    out = r.forward([a[12:], b[2:], c[1:]], slots, logits="all").logits  # counts 8, 5, 2
    assert torch.allclose(out[0, :8], ref[0][12:], atol=1e-5)
    assert torch.allclose(out[1, :5], ref[1][2:], atol=1e-5)
    assert torch.allclose(out[2, :2], ref[2][1:], atol=1e-5)
    last = r.forward([a[12:], b[2:], c[1:]], slots).logits  # "last" logits of each row
    assert torch.allclose(last, torch.stack([ref[0][-1], ref[1][-1], ref[2][-1]]), atol=1e-5)


def test_rollback_then_rewrite(tiny_llama):
    r = ModelRunner(tiny_llama, num_slots=1, max_len=64)
    s = r.cache.allocate()
    r.forward([[1, 2, 3, 4, 5, 6]], [s])
    r.cache.commit(s, 6)
    r.cache.rollback(s, 3)  # forget 4, 5, 6 and write something else there
    out = r.forward([[40, 41]], [s], logits="all").logits[0]
    assert torch.allclose(out, hf_logits(tiny_llama, [1, 2, 3, 40, 41])[3:], atol=1e-5)


def test_non_contiguous_slots_and_device_tensor_input(tiny_llama):
    r = ModelRunner(tiny_llama, num_slots=4, max_len=32)
    for _ in range(4):
        r.cache.allocate()
    ids = torch.tensor([[3, 4, 5], [6, 7, 0]], device=r.device)  # row 1 has 2 valid tokens
    out = r.forward(ids, [3, 1], counts=[3, 2], logits="all").logits
    assert torch.allclose(out[0], hf_logits(tiny_llama, [3, 4, 5]), atol=1e-5)
    assert torch.allclose(out[1, :2], hf_logits(tiny_llama, [6, 7]), atol=1e-5)


def test_rows_in_a_span_of_slots_leave_the_idle_slots_exact(tiny_llama):
    """Rows in slots 4, 0, 1 run as the span 0..4 (slots 2 and 3 idle rows); slots 0 and 4 as
    a span of 5 for 2 rows gather their keys instead. Both match transformers, and slot 2's
    committed cache (a sequence prefilling, say) is left exact."""
    r = ModelRunner(tiny_llama, num_slots=5, max_len=32)
    for _ in range(5):
        r.cache.allocate()
    held = [11, 12, 13, 14]
    r.forward([held], [2])
    r.cache.commit(2, len(held))
    before = [(k[2, :, :4].clone(), v[2, :, :4].clone()) for k, v in zip(r.cache.k, r.cache.v)]
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    out = r.forward(prompts, [4, 0, 1], logits="all").logits  # span path
    for b, ids in enumerate(prompts):
        assert torch.allclose(out[b, : len(ids)], hf_logits(tiny_llama, ids), atol=1e-5)
    for (k0, v0), k, v in zip(before, r.cache.k, r.cache.v):
        assert torch.equal(k[2, :, :4], k0) and torch.equal(v[2, :, :4], v0)
    cont = r.forward([[15, 16]], [2], logits="all").logits[0]
    assert torch.allclose(cont, hf_logits(tiny_llama, held + [15, 16])[4:], atol=1e-5)
    out = r.forward([[20, 21], [22]], [0, 4], logits="all").logits  # span 5 > 2 rows x 2: gathered
    assert torch.allclose(out[0], hf_logits(tiny_llama, [20, 21]), atol=1e-5)
    assert torch.allclose(out[1, :1], hf_logits(tiny_llama, [22]), atol=1e-5)


def test_first_layers_only(tiny_llama):
    r = ModelRunner(tiny_llama, num_slots=1, max_len=32, num_layers=1)
    assert len(r.weights) == 1 and len(r.cache.k) == 1
    with pytest.raises(ValueError):
        ModelRunner(tiny_llama, 1, 32, num_layers=9)


def test_forward_past_max_len_refused(tiny_llama):
    r = ModelRunner(tiny_llama, num_slots=1, max_len=4)
    s = r.cache.allocate()
    with pytest.raises(ValueError):
        r.forward([[1, 2, 3, 4, 5]], [s])


def test_unsupported_architecture_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelRunner(m, 1, 16)
