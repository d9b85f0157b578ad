"""Drafter fault isolation: the engine's only way to call a drafter.

Invariant: a drafter fault never costs a token. Any exception in ``add``, ``observe``,
``propose``, ``commit`` or ``remove``, or a malformed proposal, makes that round a plain round
(K = 0) for the rows the call was for, and those rows decode plainly (no drafting) for the rest
of their life: the target alone decides every token of a K = 0 round, so their output is still
exactly the target's. Each fault adds one to :attr:`GuardedDrafter.failures` (a metric reads it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from engine.drafters.base import Drafter, Proposal
from engine.records.params import SpecParams
from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence

log = logging.getLogger("specd.engine")
T = TypeVar("T")


class GuardedDrafter:
    def __init__(self, inner: Drafter):
        self.inner = inner
        self.failures = 0  # faults so far (each fell back to K = 0 for its rows)

    def add(self, seqs: list[Sequence], lazy: bool = False) -> None:
        self._guard("add", seqs, lambda: self.inner.add(seqs, lazy))

    def remove(self, seq: Sequence) -> None:
        self._guard("remove", [seq], lambda: self.inner.remove(seq))

    def fork(self, src: Sequence, dst: Sequence) -> None:
        self._guard("fork", [dst], lambda: self.inner.fork(src, dst))

    def observe(
        self,
        seqs: list[Sequence],
        hidden: torch.Tensor | None,
        starts: list[int],
        counts: list[int],
    ) -> None:
        """The target's tapped states of the forward that just ran (a no-op unless the drafter
        reads taps)."""
        if self.inner.taps and hidden is not None:
            self._guard("observe", seqs, lambda: self.inner.observe(seqs, hidden, starts, counts))

    def commit(self, seqs: list[Sequence]) -> None:
        self._guard("commit", seqs, lambda: self.inner.commit(seqs))

    def backlogs(self, seqs: list[Sequence]) -> list[int]:
        return self._guard("backlogs", seqs, lambda: self.inner.backlogs(seqs)) or [0] * len(seqs)

    def own_path(self) -> str | None:
        return self.inner.own_path()

    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal | None:
        """The drafter's proposal for ``seqs`` (all rows of the round), or None: a plain round."""
        drafting = [s for s, k in zip(seqs, plan.ks) if k]
        prop = self._guard("propose", drafting, lambda: self.inner.propose(seqs, plan))
        if prop is not None and not well_formed(prop, plan.ks):
            self.fault("propose", drafting, ValueError("malformed proposal"))
            return None
        return prop

    def _guard(self, where: str, rows: list[Sequence], call: Callable[[], T]) -> T | None:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 -- any drafter failure falls back to plain decoding
            self.fault(where, rows, e)
            return None

    def fault(self, where: str, rows: list[Sequence], err: Exception) -> None:
        """Count the fault; ``rows`` decode plainly from now on."""
        self.failures += 1
        log.error(
            "drafter %s failed in %s (%s: %s); %d request(s) fall back to plain decoding",
            self.inner.name,
            where,
            type(err).__name__,
            err,
            len(rows),
        )
        for s in rows:
            s.spec = SpecParams(enabled=False, k=0, k_max=0)


def well_formed(prop: Proposal, ks: list[int]) -> bool:
    """Host-side shape checks of a proposal (no device sync)."""
    b, t = len(ks), prop.tokens
    return (
        t.dim() == 2
        and t.shape[0] == b
        and len(prop.num) == b
        and all(0 <= n <= k for n, k in zip(prop.num, ks))
        and t.shape[1] >= max(prop.num + [0])
        and t.shape[1] <= max(ks + [0])
        and (prop.probs is None or tuple(prop.probs.shape[:2]) == tuple(t.shape))
        and (prop.copied is None or len(prop.copied) == b)
        and (
            prop.alternatives is None
            or (
                prop.alternatives.tokens.shape == prop.alternatives.values.shape
                and prop.alternatives.tokens.dim() == 3
                and prop.alternatives.tokens.shape[0] == b
                and prop.alternatives.tokens.shape[1] <= t.shape[1]
                and (prop.alternatives.sizes is None or len(prop.alternatives.sizes) == b)
            )
        )
    )
