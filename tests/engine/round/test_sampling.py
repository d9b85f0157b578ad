import pytest
import torch

from engine.records.params import SamplingParams
from engine.sampling.probs import logits_to_probs


def probs(logits, t=1.0, k=0, p=1.0):
    B = logits.shape[0]
    return logits_to_probs(logits, torch.full((B,), t), torch.full((B,), k), torch.full((B,), p))


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    assert probs(logits, 0.5)[0, 0, 0] > probs(logits, 1.0)[0, 0, 0] > probs(logits, 2.0)[0, 0, 0]


def test_top_k_keeps_k_tokens_renormalized():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0]]])
    pr = probs(logits, k=2)[0, 0]
    assert (pr[2:] == 0).all() and torch.isclose(pr.sum(), torch.tensor(1.0))
    full = torch.softmax(logits[0, 0, :2], -1)
    assert torch.allclose(pr[:2], full)


def test_top_p_keeps_smallest_prefix_reaching_p():
    pr0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    pr = probs(pr0.log()[None, None], p=0.8)[0, 0]
    assert (pr[2:] == 0).all() and torch.allclose(pr[:2], torch.tensor([0.625, 0.375]))
    pr = probs(pr0.log()[None, None], p=0.81)[0, 0]
    assert (pr[3:] == 0).all() and pr[2] > 0


def test_top_p_always_keeps_the_top_token():
    pr = probs(torch.tensor([[[5.0, 1.0]]]), p=0.01)[0, 0]
    assert pr.tolist() == [1.0, 0.0]


def test_per_row_parameters():
    logits = torch.tensor([[[3.0, 2.0, 1.0]], [[3.0, 2.0, 1.0]]])
    pr = logits_to_probs(
        logits, torch.tensor([1.0, 1.0]), torch.tensor([1, 0]), torch.tensor([1.0, 1.0])
    )
    assert pr[0, 0].tolist() == [1.0, 0.0, 0.0] and (pr[1, 0] > 0).all()


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-1),
        dict(max_tokens=-1),
        dict(repetition_penalty=0),
        dict(prompt_logprobs=-1),
        dict(temperature=float("nan")),
    ],
)
def test_invalid_params_rejected(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)
