"""The drafter contract: propose up to K tokens per row; keep any state in step with the target.

Life cycle of a sequence as a drafter sees it: ``add`` (after the target's prefill), then each
round ``propose`` and ``commit`` (after acceptance: roll its state back to what was kept), and
``remove`` when the sequence leaves the engine. The engine calls a drafter only through
:class:`~engine.drafters.guard.GuardedDrafter`, which turns any fault into a plain round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.records.sequence import Sequence

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner
    from engine.records.plan import RoundPlan


@dataclass
class Alternatives:
    """The runners-up of each drafted token, for a draft tree (engine/round/draft_tree.py):
    candidates drawn after d_{j+1} from the same q, in the order drawn (a sampled row's are a
    sample of q without replacement, its first draw d_{j+1} itself); and deeper nodes."""

    tokens: torch.Tensor  # [batch, K', S] long: the alternatives to d_{j+1}, in order
    # [batch, K', S] float: each one's worth as a tree node (its estimated chance of being
    # accepted); -inf: none. Within a position, decreasing in the order drawn
    values: torch.Tensor
    # deeper nodes (EAGLE-2's expansion, drafters/eagle/expand.py; the suffix drafter's
    # branches, drafters/suffix.py, with no runners-up): tokens [batch, M] long,
    # worth [batch, M] (never above the parent's), parent ids [batch, M] long, in the id space
    # -1 the root, j < K' chain node j, K' + j S + r runner-up r of d_{j+1}, K' + K' S + m
    # node m of these; parents first
    more: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    branch: int = 0  # the most children a node of ``more`` has
    # [batch] bool: rows whose candidates were chosen, not drawn (tried as point masses:
    # engine/round/tree.py); None: none
    point: torch.Tensor | None = None
    point_rows: list[bool] | None = None  # ``point`` on the host
    # per row, how many candidates it has (the rest worth -inf), where the drafter knows it on
    # the host: a row's leaves are cut to it, so no verify query goes to a node that is none;
    # None: not known (as many as the leaves asked)
    sizes: list[int] | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor  # [batch, K] long on the target's device, padded past num[b]
    num: list[int]  # drafted tokens per row (<= the K asked for; may be 0)
    probs: torch.Tensor | None  # [batch, K, vocab] draft distribution; None = one-hot q
    alternatives: Alternatives | None = None  # asked by plan.siblings; K' <= K
    extra_rows: int = 0  # row-steps the drafter ran beyond its chains' (a tree's expansion)
    # per row: its draft was copied from text (n-gram, suffix), not a model's; None: none was
    copied: list[bool] | None = None


class Drafter(Protocol):
    """What the engine needs of a drafter."""

    @property
    def name(self) -> str: ...

    @property
    def samples(self) -> bool:
        """It samples from a distribution (the plan draws noise per drafted position)."""
        ...

    @property
    def trees(self) -> bool:
        """It proposes ``Alternatives`` when ``plan.alternatives`` asks (a draft tree's leaves,
        engine/round/draft_tree.py)."""
        ...

    @property
    def runner(self) -> ModelRunner | None:
        """Its own model runner (compiled and timed with the target's), if it has one."""
        ...

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose inputs (hidden states) the drafter reads through ``observe``
        (EAGLE-3: low, middle, high); empty: it reads none."""
        ...

    def steps(self, width: int) -> int:
        """Sequential drafting steps to propose ``width`` tokens (the K controller's cost)."""
        ...

    def own_path(self) -> str | None:
        """How a forward of the drafter's own (not its runner's: the EAGLE-3 head's step) runs
        now, for the forward-path gauge; None where it has none."""
        ...

    def backlogs(self, seqs: list[Sequence]) -> list[int]:
        """Per row, the positions beyond one that its next ``propose`` would take in first: what
        its state missed while the row did not draft (0: a stateless drafter). The K controller
        prices this catch-up."""
        ...

    def observe(
        self, seqs: list[Sequence], hidden: torch.Tensor, starts: list[int], counts: list[int]
    ) -> None:
        """After a target forward (a prefill chunk or a verify) when ``taps`` is not empty:
        ``hidden`` ``[batch, q, len(taps) * hidden]`` holds the tapped states of positions
        ``[starts[b], starts[b] + counts[b])`` of row b (a verify's rejected positions
        included: ``commit`` drops them)."""
        ...

    def add(self, seqs: list[Sequence], lazy: bool = False) -> None:
        """New sequences whose target prefill just ran. ``lazy``: the K controller expects no
        draft soon (``KController.expects_drafts``): work that only drafting needs may wait."""
        ...

    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        """Up to ``plan.ks[b]`` tokens for row b (0 = none). A sampling drafter samples with the
        plan's row params and its ``draft_noise`` (Exp(1) draws from each row's generator)."""
        ...

    def commit(self, seqs: list[Sequence]) -> None:
        """After the round's tokens were appended to each sequence: drop what was rejected."""
        ...

    def remove(self, seq: Sequence) -> None:
        """The sequence left the engine: free its state."""
        ...

    def warm_up(self) -> None:
        """Compile whatever the drafter compiles (before serving); a failure leaves it eager."""
        ...

    def fork(self, src: Sequence, dst: Sequence) -> None:
        """``dst`` (not yet added) takes a copy of ``src``'s prefill (the same prompt) instead of
        a prefill of its own: whatever ``observe`` kept of ``src``'s prompt."""
        ...


class DrafterBase:
    """Defaults for a stateless drafter that needs one step per drafted token."""

    name: str = "drafter"
    samples: bool = False
    trees: bool = False
    runner: ModelRunner | None = None
    taps: tuple[int, ...] = ()

    def backlogs(self, seqs: list[Sequence]) -> list[int]:
        return [0] * len(seqs)

    def own_path(self) -> str | None:
        """How a forward of the drafter's own (not its runner's) runs now; None: it has none."""
        return None

    def steps(self, width: int) -> int:
        return width

    def observe(
        self, seqs: list[Sequence], hidden: torch.Tensor, starts: list[int], counts: list[int]
    ) -> None:
        return None

    def add(self, seqs: list[Sequence], lazy: bool = False) -> None:
        return None

    def commit(self, seqs: list[Sequence]) -> None:
        return None

    def remove(self, seq: Sequence) -> None:
        return None

    def fork(self, src: Sequence, dst: Sequence) -> None:
        return None

    def warm_up(self) -> None:
        return None
