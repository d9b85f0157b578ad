"""The plan of one round: every row's K, sampling parameters and random draws, decided on the host.

Invariants:
  * Everything the round branches on (K per row, whether any row filters top-k / top-p, which
    rows sample) is a host value here: the round never reads a device tensor to decide.
  * Random draws: rows without a seed take theirs from the engine's generator in one batched call
    per tensor; a seeded row draws from its own generator, in a fixed order (draft noise
    [K_i, vocab] for sampling drafters, uniforms [K_i], noise [vocab]), so its draws depend only
    on its own K in that round, never on the batch beside it. Greedy rows draw nothing.
"""

from __future__ import annotations

import torch

from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence
from engine.sampling.probs import needs_filter
from engine.transfer import to_device


def make_plan(
    seqs: list[Sequence],
    ks: list[int],
    vocab: int,
    device: torch.device,
    rng: torch.Generator,
    sample_drafts: bool,
) -> RoundPlan:
    """The plan for ``seqs`` drafting ``ks`` tokens; ``sample_drafts``: the drafter samples."""
    batch, kmax = len(seqs), max(ks + [0])
    params = [s.params for s in seqs]
    draft_noise = torch.ones(batch, kmax, vocab, device=device) if sample_drafts else None
    uniforms = torch.zeros(batch, kmax, device=device)  # [batch, K]
    sampling = any(not s.params.greedy for s in seqs)
    noise = torch.ones(batch, vocab, device=device) if sampling else None  # [batch, vocab]
    shared = [b for b, s in enumerate(seqs) if not s.params.greedy and s.generator is None]
    if shared:  # rows without a seed: one batched draw per tensor from the engine's generator
        assert noise is not None
        rows = to_device(shared, torch.long, device)
        n = len(shared)
        noise[rows] = torch.empty(n, vocab, device=device).exponential_(generator=rng)
        if kmax:
            uniforms[rows] = torch.rand(n, kmax, generator=rng, device=device)
            if draft_noise is not None:
                draft_noise[rows] = torch.empty(n, kmax, vocab, device=device).exponential_(
                    generator=rng
                )
    for b, (s, k) in enumerate(zip(seqs, ks)):
        g = s.generator
        if s.params.greedy or g is None:
            continue
        if draft_noise is not None and k:
            draft_noise[b, :k].exponential_(generator=g)
        if k:
            uniforms[b, :k] = torch.rand(k, generator=g, device=device)
        assert noise is not None
        noise[b].exponential_(generator=g)
    return RoundPlan(
        ks=ks,
        params=params,
        filter_rows=needs_filter(params),
        temperature=to_device([p.temperature or 1.0 for p in params], torch.float32, device),
        top_k=to_device([p.top_k for p in params], torch.long, device),
        top_p=to_device([p.top_p for p in params], torch.float32, device),
        greedy=to_device([p.greedy for p in params], torch.bool, device),
        last=to_device([s.last_token for s in seqs], torch.long, device)[:, None],
        draft_noise=draft_noise,
        uniforms=uniforms,
        noise=noise,
    )
