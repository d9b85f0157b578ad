"""The plan of one round, as the drafters and the round read it (made by engine/round/plan.py,
where its invariants are stated)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.records.params import SamplingParams


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
