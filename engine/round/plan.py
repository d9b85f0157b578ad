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

from dataclasses import dataclass

import torch

from engine.requests.sequence import Sequence
from engine.round.sampling import SamplingParams, needs_filter
from engine.transfer import to_device


@dataclass
class RoundPlan:
    """What the plan decided for every row of one round (device tensors are [batch, ...])."""

    ks: list[int]  # K_i asked of the drafter (host)
    params: list[SamplingParams]  # each row's sampling parameters (host)
    filter_rows: bool  # some row uses top-k / top-p (host)
    temperature: torch.Tensor  # [batch] float, 1.0 for greedy rows
    top_k: torch.Tensor  # [batch] long, 0 = off
    top_p: torch.Tensor  # [batch] float
    greedy: torch.Tensor  # [batch] bool
    last: torch.Tensor  # [batch, 1] long: the last emitted token, first verify input
    draft_noise: torch.Tensor | None  # [batch, K, vocab] Exp(1), for sampling drafters
    uniforms: torch.Tensor  # [batch, K] acceptance draws
    # [batch, vocab] Exp(1), for the recovered / bonus sample; None when every row is greedy
    noise: torch.Tensor | None
    # the nodes past its chain each row's draft tree may keep (engine/round/draft_tree.py;
    # host); None: chains only
    leaves: list[int] | None = None

    @property
    def alternatives(self) -> int:
        """Runners-up the drafter adds to each drafted token (Proposal.alternatives): the most
        any row's tree keeps; 0: chains only."""
        return max(self.leaves or [0])

    @property
    def num_zero(self) -> torch.Tensor:
        return torch.zeros_like(self.greedy, dtype=torch.long)


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
