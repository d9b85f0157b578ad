"""The drafter interface: propose up to K tokens per row; keep any state in step with the target.

Life cycle of a sequence as a drafter sees it: ``add`` (after the target's prefill), then each
round ``propose`` and ``commit`` (after acceptance: roll its state back to what was kept), and
``remove`` when the sequence leaves the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sequence import Sequence

if TYPE_CHECKING:
    from ..engine import RoundPlan


@dataclass
class Proposal:
    tokens: torch.Tensor  # [batch, K] long on the target's device, padded past num[b]
    num: list[int]  # drafted tokens per row (<= the K asked for; may be 0)
    probs: (
        torch.Tensor | None
    )  # [batch, K, vocab] draft distribution, None = one-hot (deterministic)
    tokens_host: list[list[int]] | None = None  # when the drafter already has them on the host


class Drafter(ABC):
    name: str = "drafter"
    samples: bool = False  # True when it samples from a distribution (needs noise per position)

    def steps(self, width: int) -> int:
        """Sequential drafting steps to propose ``width`` tokens (the K controller's cost model)."""
        return width

    def add(self, seqs: list[Sequence]) -> None:
        """New sequences whose target prefill just ran."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        """Up to ``plan.ks[b]`` tokens for row b (0 = none). A sampling drafter samples with the
        plan's row params and its ``draft_noise`` (Exp(1) draws from each row's generator)."""

    def commit(self, seqs: list[Sequence]) -> None:
        """After the round's tokens were appended to each sequence: drop what was rejected."""

    def remove(self, seq: Sequence) -> None:
        """The sequence left the engine: free its state."""
