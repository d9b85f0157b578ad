"""A head's held-out acceptance per draft step, teacher-forced: greedy and sampled.

At draft step j (train/ttt.py's step j, fed the true tokens before it) the head proposes from q,
its distribution over the draft vocabulary (zero outside it), where the target's distribution is
p over its whole vocabulary:

* greedy: the draft is accepted when the head's top token is the target's (top-1 agreement);
* sampled at T = 1: the rejection rule accepts a draft x ~ q with probability min(1, p(x)/q(x)),
  so on average with probability ``sum_x min(p(x), q(x))`` (the overlap of the two
  distributions), which the soft labels train for and the hard ones do not.

Positions count where the loss counts (the target's top token is in the draft vocabulary). p is
normalized over the target's whole vocabulary, so the overlap is the true acceptance
probability at that position, not one over the draft vocabulary alone.
"""

from __future__ import annotations

import torch

from engine.model.runner import ModelRunner

from .batches import Row, batches, to_batch
from .feature_cache import FeatureCache
from .ttt import TTTForward, step_predictions


def overlap(target_logits: torch.Tensor, lse: torch.Tensor, head_logits: torch.Tensor):
    """``sum_x min(p(x), q(x))`` per position: ``target_logits`` ``[N, Vd]`` the target's logits
    over the draft vocabulary, ``lse`` ``[N]`` their log-normalizer over the *whole* vocabulary,
    ``head_logits`` ``[N, Vd]`` the head's. Returns ``[N]``."""
    p = (target_logits.float() - lse.float()[:, None]).exp()  # the target's mass on draft ids
    q = head_logits.float().softmax(-1)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def acceptance_by_step(
    fwd: TTTForward,
    runner: ModelRunner,
    cache: FeatureCache,
    rows: list[Row],
    steps: int,
    tokens: int,
    bf16: bool,
    sampled: bool = True,
) -> tuple[list[float], list[float]]:
    """(greedy, sampled) acceptance per draft step over ``rows``, weighted by the positions
    each step counts. ``sampled=False`` skips the T = 1 half (the target's log-normalizer over
    its whole vocabulary, one LM-head pass over every position) and returns zeros for it."""
    head = fwd.head
    ids, t2d = head.draft_to_target, head.t2d
    greedy, overlaps, n = [0.0] * steps, [0.0] * steps, [0.0] * steps
    for group in batches(rows, tokens, seed=0):
        f = cache.features(runner, group, t2d)
        b = to_batch(runner, f, ids)
        if sampled:
            flat = f.hidden.reshape(-1, f.hidden.shape[-1]).to(runner.device)
            lse = torch.cat([runner.logits(c).logsumexp(-1) for c in flat.split(1024)])
            lse = lse.view(f.hidden.shape[:2])  # [B, S]
        with torch.autocast(runner.device.type, dtype=torch.bfloat16, enabled=bf16):
            outs = fwd(b.feats, b.tokens, steps)
        for j, mask, q in step_predictions(head.lm_head, outs, b.predict):
            tl = b.target_logits[:, 1 + j :][mask]  # [N, Vd]
            greedy[j] += float((q.argmax(-1) == tl.argmax(-1)).sum())
            if sampled:
                overlaps[j] += float(overlap(tl, lse[:, 1 + j :][mask], q).sum())
            n[j] += float(mask.sum())
    return [g / max(c, 1) for g, c in zip(greedy, n)], [o / max(c, 1) for o, c in zip(overlaps, n)]
