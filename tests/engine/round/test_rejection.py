"""The rejection sampler alone: exact cases and a statistical proof that output ~ target."""

import math

import pytest
import torch

from engine.round.rejection import rejection_sample
from tests.distribution import ALPHA, chi_square_gof


def onehot_probs(rows):  # rows: list of list of argmax ids -> [batch, t, vocab=8] peaked probs
    p = torch.full((len(rows), len(rows[0]), 8), 0.01)
    for b, r in enumerate(rows):
        for j, t in enumerate(r):
            p[b, j, t] = 1.0
    return p / p.sum(-1, keepdim=True)


def run_greedy(p, drafts, num):
    B = p.shape[0]
    k = drafts.shape[1]
    return rejection_sample(
        p,
        drafts,
        torch.tensor(num),
        None,
        torch.ones(B, dtype=torch.bool),
        torch.zeros(B, k),
        torch.ones(B, p.shape[-1]),
    )


@pytest.mark.parametrize("k", [0, 1, 4])
def test_all_greedy_rule_on_logits_equals_the_rule_on_probs(k):
    """With no noise (every row greedy) the rule takes argmaxes only, so the round may pass its
    logits and skip the softmax: the same accepted counts and tokens as on the probabilities,
    for drafts that match the argmax for a while and then not, ragged rows included."""
    g = torch.Generator().manual_seed(k)
    B, V = 6, 50
    logits = torch.randn(B, k + 1, V, generator=g) * 3
    drafts = logits[:, :k].argmax(-1)  # [B, K] every draft the argmax ...
    for b in range(B):  # ... until row b's own break point (b > K: all accepted)
        if b < k:
            drafts[b, b] = (drafts[b, b] + 1) % V
    num = torch.tensor([min(k, n) for n in (k, k, 1, 0, k, 2)])
    args = (drafts, num, None, torch.ones(B, dtype=torch.bool), torch.zeros(B, k))
    ref = rejection_sample(torch.softmax(logits, -1), *args, torch.ones(B, V))
    got = rejection_sample(logits, *args, None)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    expect = [min(b, int(n)) if b < k else int(n) for b, n in enumerate(num)]
    assert got[0].tolist() == expect


def test_greedy_perfect_match_takes_bonus():
    p = onehot_probs([[3, 4, 5, 6]])
    a, t = run_greedy(p, torch.tensor([[3, 4, 5]]), [3])
    assert a.tolist() == [3] and t.tolist() == [6]


def test_greedy_first_position_mismatch_recovers_target_token():
    p = onehot_probs([[3, 4, 5, 6]])
    a, t = run_greedy(p, torch.tensor([[1, 4, 5]]), [3])
    assert a.tolist() == [0] and t.tolist() == [3]


def test_greedy_mid_mismatch_stops_at_first_rejection():
    p = onehot_probs([[3, 4, 5, 6]])
    a, t = run_greedy(p, torch.tensor([[3, 7, 5]]), [3])  # later match must not count
    assert a.tolist() == [1] and t.tolist() == [4]


def test_empty_draft_is_plain_decoding():
    p = onehot_probs([[2]])
    a, t = run_greedy(p, torch.zeros(1, 0, dtype=torch.long), [0])
    assert a.tolist() == [0] and t.tolist() == [2]


def test_ragged_batch():
    p = onehot_probs([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0], [1, 1, 1, 1]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 0], [5, 0, 0], [0, 0, 0]])
    # row 1 drafted 2 (third slot is padding that happens to mismatch), row 2 one, row 3 none
    a, t = run_greedy(p, drafts, [3, 2, 1, 0])
    assert a.tolist() == [3, 2, 1, 0]
    assert t.tolist() == [4, 3, 6, 1]


def test_padding_past_num_draft_is_never_accepted():
    p = onehot_probs([[1, 2, 3, 4]])
    a, t = run_greedy(p, torch.tensor([[1, 2, 3]]), [1])
    assert a.tolist() == [1] and t.tolist() == [2]  # bonus comes from position num_draft


def test_sampled_one_hot_draft_rejected_token_is_never_recovered():
    # q one-hot on token 0, p puts mass on 0 and 1: a rejection must resample from p minus token 0
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        u = torch.rand(1, 1, generator=gen)
        e = torch.empty(1, 4).exponential_(generator=gen)
        a, t = rejection_sample(
            p, torch.tensor([[0]]), torch.tensor([1]), None, torch.tensor([False]), u, e
        )
        if a.item() == 0:
            assert t.item() == 1


def test_sampled_draft_probs_equal_to_target_always_accept():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(3, 4, 10, generator=g), -1)
    drafts = torch.multinomial(p[:, :3].reshape(-1, 10), 1, generator=g).reshape(3, 3)
    u = torch.rand(3, 3, generator=g) * 0.999
    a, _ = rejection_sample(
        p,
        drafts,
        torch.tensor([3, 3, 3]),
        p[:, :3].clone(),
        torch.zeros(3, dtype=torch.bool),
        u,
        torch.ones(3, 10),
    )
    assert a.tolist() == [3, 3, 3]


# -- statistical ----------------------------------------------------------------------------
def _tv_bound(p: torch.Tensor, n: int) -> float:
    """A 5-sigma-per-category bound on the total-variation distance of an n-sample histogram."""
    return 0.5 * float((5 * torch.sqrt(p * (1 - p) / n)).sum()) + 1e-9


def _process(logits, temperature, top_p):
    from engine.sampling.probs import logits_to_probs

    B = logits.shape[0]
    return logits_to_probs(
        logits,
        torch.full((B,), temperature),
        torch.zeros(B, dtype=torch.long),
        torch.full((B,), top_p),
    )


@pytest.mark.parametrize(
    "k,temperature,top_p,one_hot",
    [
        (1, 1.0, 1.0, False),
        (3, 0.7, 1.0, False),
        (5, 1.3, 0.9, False),
        (3, 1.0, 0.8, True),
        (8, 1.0, 1.0, True),
    ],
)
def test_emitted_tokens_are_distributed_as_target(k, temperature, top_p, one_hot):
    """Fixed p and q per position (context-free), n = 120k draws in one batch: every position's
    emitted token (accepted draft, recovered or bonus) follows p, far from q."""
    vocab, n = 6, 120_000
    g = torch.Generator().manual_seed(1234 + k)
    tl = torch.randn(1, k + 1, vocab, generator=g) * 1.5
    dl = torch.randn(1, k, vocab, generator=g) * 1.5
    p = _process(tl, temperature, top_p)[0]  # [k+1, vocab]
    q = _process(dl, temperature, top_p)[0]  # [k, vocab]
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.contiguous()  # [n, k]
    draft_probs = None if one_hot else q.expand(n, k, vocab)
    if one_hot:  # a deterministic drafter always proposes the same tokens
        drafts = q.argmax(-1).expand(n, k).contiguous()
        q = torch.nn.functional.one_hot(q.argmax(-1), vocab).float()
    a, t = rejection_sample(
        p.expand(n, k + 1, vocab),
        drafts,
        torch.full((n,), k),
        draft_probs,
        torch.zeros(n, dtype=torch.bool),
        torch.rand(n, k, generator=g),
        torch.empty(n, vocab).exponential_(generator=g),
    )
    for j in range(k + 1):  # position j is emitted iff a >= j
        reached = a >= j
        emitted = torch.where(a[reached] > j, drafts[reached, min(j, k - 1)], t[reached])
        m = int(reached.sum())
        if m < 2000:
            break
        counts = torch.bincount(emitted, minlength=vocab)
        hist = counts.float() / m
        tv_p = 0.5 * float((hist - p[j]).abs().sum())
        assert tv_p < _tv_bound(p[j], m), (j, tv_p, hist, p[j])
        # and a goodness-of-fit test at a fixed significance (the TV bound above is loose)
        _, pval, _ = chi_square_gof(
            dict(enumerate(counts.tolist())), dict(enumerate(p[j].tolist()))
        )
        assert pval >= ALPHA, (j, pval, hist, p[j])
        if j < k:
            tv_q = 0.5 * float((p[j] - q[j]).abs().sum())
            assert tv_q > 4 * _tv_bound(p[j], m) or tv_q < 0.02, "test too weak: q too close to p"
    assert int(a.min()) >= 0 and int(a.max()) <= k
    assert j >= 1, "too few draws reached the second position for the test to mean much"


def test_acceptance_rate_matches_theory():
    """Per position, P(accept) = sum_x min(p(x), q(x)) (Leviathan et al., Theorem 3.5)."""
    vocab, n = 5, 100_000
    g = torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(1, vocab, generator=g), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, 1]
    a, _ = rejection_sample(
        p.expand(n, 2, vocab),
        drafts,
        torch.ones(n, dtype=torch.long),
        q.expand(n, 1, vocab),
        torch.zeros(n, dtype=torch.bool),
        torch.rand(n, 1, generator=g),
        torch.ones(n, vocab),
    )
    expected = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float(a.float().mean()) - expected) < 5 * math.sqrt(expected * (1 - expected) / n)
