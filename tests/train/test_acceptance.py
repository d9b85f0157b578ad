"""train/acceptance.py: the sampled acceptance is the overlap of the target's distribution over
its whole vocabulary with the head's over the draft vocabulary."""

import torch

from train.acceptance import overlap


def test_overlap_is_the_rejection_rules_acceptance_probability():
    """sum_x min(p(x), q(x)) with p normalized over the whole vocabulary (draft ids 0..3 of a
    7-token vocabulary), against a direct computation."""
    torch.manual_seed(0)
    full = torch.randn(5, 7)  # the target's logits over its whole vocabulary
    draft = torch.tensor([4, 0, 6, 2])  # draft id i is target id draft[i]
    head = torch.randn(5, 4)
    got = overlap(full[:, draft], full.logsumexp(-1), head)
    p = full.softmax(-1)[:, draft]
    q = head.softmax(-1)
    want = torch.tensor(
        [sum(min(float(a), float(b)) for a, b in zip(pr, qr)) for pr, qr in zip(p, q)]
    )
    torch.testing.assert_close(got, want)
    # the target's mass outside the draft vocabulary can never be accepted
    assert bool((got <= p.sum(-1) + 1e-6).all())


def test_overlap_is_one_when_the_head_is_the_target_inside_the_draft_vocabulary():
    logits = torch.randn(3, 4)
    ones = overlap(logits, logits.logsumexp(-1), logits)
    torch.testing.assert_close(ones, torch.ones(3))
    far = overlap(
        torch.tensor([[20.0, -20.0]]), torch.tensor([20.0]), torch.tensor([[-20.0, 20.0]])
    )
    assert float(far) < 1e-6  # disjoint: nothing accepted
