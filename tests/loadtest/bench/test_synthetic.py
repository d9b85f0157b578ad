"""The benchmark-only synthetic acceptance rule (loadtest/bench/synthetic.py): it accepts each
drafted token with probability α, and an engine that uses it is refused by the worker."""

import pytest
import torch

from engine.round.rejection import rejection_sample
from engine.worker.worker import EngineWorker
from loadtest.bench.synthetic import SyntheticAccept, bound
from tests.helpers import engine_for


def test_accepts_leading_drafts_at_rate_alpha():
    batch, k, vocab, alpha = 4000, 4, 11, 0.8
    probs = torch.softmax(torch.randn(batch, k + 1, vocab), -1)  # [batch, K+1, vocab]
    drafts = torch.randint(0, vocab, (batch, k))
    num_draft = torch.tensor([k, 2, 0, k] * (batch // 4))
    accept = SyntheticAccept(torch.Generator().manual_seed(0), alpha)
    num_acc, nxt = accept(probs, drafts, num_draft, None, None, None, None)
    assert (num_acc <= num_draft).all()
    assert (num_acc[2::4] == 0).all()
    full = num_acc[0::4].float()
    expected = sum(alpha**j for j in range(1, k + 1))  # E[accepted] of a geometric run, cut at K
    assert abs(full.mean().item() - expected) < 0.1
    rows = torch.arange(batch)
    assert torch.equal(nxt, probs[rows, num_acc].argmax(-1))


def test_bound():
    assert bound(0.8, 4, 0.0) == pytest.approx((1 - 0.8**5) / 0.2)
    assert bound(0.6, 2, 0.5) == pytest.approx((1 + 0.6 + 0.36) / 2)


def test_worker_refuses_an_engine_with_synthetic_acceptance(tiny_llama):
    EngineWorker(engine_for(tiny_llama, None, slots=1, max_len=64))  # the exact rule is served
    synthetic = SyntheticAccept(torch.Generator(), 0.9)  # what the benchmark builds
    engine = engine_for(tiny_llama, None, slots=1, max_len=64, accept=synthetic)
    with pytest.raises(ValueError, match="refusing to serve"):
        EngineWorker(engine)
    EngineWorker(engine_for(tiny_llama, None, slots=1, max_len=64, accept=rejection_sample))
