"""The measured cost of one speculative round, T(B, w), and the fit behind it.

One round of a batch of B rows whose widest draft is w tokens costs
    T(B, w) = a + b·B + c·B·w + f·B·[w > 0] + t·[tree]  +  s(w)·(d + e·B + h·[tree])
- the verify forward pads every row to w + 1 query tokens, so the target's cost (with the round's
  sampling and bookkeeping, a + b·B + c·B·w + f·B·[w > 0]) is set by the batch's widest draft,
  not by each row's own K. The term f·B·[w > 0] lets the first verified token cost other
  than the next ones: on a CPU the first draft token of a verify may cost less than each one
  after it, and a least-squares line through the calibrated w = 0, 1, 3, 7 then prices w = 1
  too dear, at the margin where K = 1 pays a few per cent (docs/measurements.md). Where a
  forward pads B and w + 1 further (the fast path's buckets,
  ``ModelRunner.padded_shape``), ``shape`` maps them to the padded values first: widths that pad
  to one verify shape are priced alike;
- a round with draft trees (engine/round/draft_tree.py) pays its own host work beside the
  verify's extra queries (priced as the width they pad to): t, once a round, for growing the
  trees, the tree rule and laying the paths out as chains (the round's part after its draft
  phase), and h a draft step for the head's runners-up. On a CPU they are tens of small ops,
  as dear as a verified token or more, and a tree that does not cover them loses; they are
  learned from the tree rounds themselves (t and h stay 0, the ridge's, until a round with
  trees was seen);
- the drafter runs s(w) sequential steps (the caller says how many) of d + e·B each, plus
  g·C for its catch-up: C positions beyond one a row, summed over the drafting rows, that a
  stateful drafter (a draft model, an EAGLE head) takes in first (drafters/base.py ``backlogs``):
  what its state missed while the row did not draft. A probe after a stretch at K = 0 pays it
  at once; a draft model's catch-up has no bound (every token it missed), so at a large batch
  a probe may cost more than the rounds it could save.

Fit: exponentially weighted least squares over every round's measured times: the round without its
draft phase on features [1, B, B·w, B·[w > 0], [tree]], the draft phase on [s, s·B, C, s·[tree]]
(s·B counting an expansion's extra head rows: drafters/eagle/expand.py). Start-up
calibration points (engine/kcontrol/calibration.py) stay in the fit as fixed pseudo-observations
that never decay, so the slope c is known before traffic has ever varied w; a tiny ridge keeps the
fit solvable before any data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

CALIBRATION_WEIGHT = 0.5  # weight of one calibration point, in rounds

Shape = Callable[[int, int], tuple[int, int]]  # (batch, q) -> (rows, q) a forward really runs


class CostModel(Protocol):
    """The round-cost model a controller prices draft widths with."""

    shape: Shape

    def observe(
        self,
        batch: int,
        width: int,
        steps: int,
        rest_s: float,
        draft_s: float,
        catch_up: int = 0,
        extra_rows: int = 0,
        tree: bool = False,
    ) -> None:
        """One measured round: B rows, padded width w, ``steps`` draft steps, ``catch_up``
        positions the drafter took in for rounds it missed, ``extra_rows`` row-steps its draft
        steps ran beyond steps x B (a draft tree's expansion), ``tree``: some row was verified
        as a tree; the round's time without its draft phase, and the draft phase's time."""

    def predict(
        self, batch: int, width: int, steps: int, catch_up: int = 0, tree: bool = False
    ) -> float:
        """Predicted seconds of a round (> 0); ``tree``: with draft trees' own work."""
        ...

    def add_calibration(self, batch: int, width: int, seconds: float) -> None:
        """A fixed point: a target forward of ``batch`` rows of ``width + 1`` tokens."""

    def add_step_calibration(self, batch: int, seconds: float, catch_up: int = 0) -> None:
        """A fixed point: one draft step of ``batch`` rows that took in ``catch_up`` positions
        beyond one a row first."""


class EWLeastSquares:
    """y ≈ θ·x by exponentially weighted least squares, plus fixed pseudo-observations (the
    start-up calibration) that never decay."""

    def __init__(self, dim: int, decay: float):
        self.decay = decay
        self.a = np.zeros((dim, dim))
        self.b = np.zeros(dim)
        self.a_fixed = np.eye(dim) * 1e-9
        self.b_fixed = np.zeros(dim)
        self._theta: np.ndarray | None = None

    def add_fixed(self, x, y: float, weight: float) -> None:
        x = np.asarray(x, dtype=float)
        self.a_fixed += weight * np.outer(x, x)
        self.b_fixed += weight * x * y
        self._theta = None

    def update(self, x, y: float) -> None:
        x = np.asarray(x, dtype=float)
        self.a = self.decay * self.a + np.outer(x, x)
        self.b = self.decay * self.b + x * y
        self._theta = None

    @property
    def theta(self) -> np.ndarray:
        """The fit, solved when first needed after new data (not on every round's update)."""
        if self._theta is None:
            self._theta = np.linalg.lstsq(self.a + self.a_fixed, self.b + self.b_fixed, rcond=None)[
                0
            ]
        return self._theta

    def predict(self, x) -> float:
        return float(np.dot(self.theta, x))


def _unpadded(batch: int, q: int) -> tuple[int, int]:
    return batch, q


class RoundCost:
    """The measured cost model T(B, w) of one round (see the module docstring); a ``CostModel``.

    ``shape(batch, q) -> (rows, q)``: the shape a target forward really runs; B and w enter the
    features padded, so every draft width that pads to the same verify shape is priced alike."""

    def __init__(self, decay: float = 0.98, shape: Shape = _unpadded):
        # round minus draft phase ~ [1, B, B·w, B·[w>0], [tree]]
        self.rest = EWLeastSquares(5, decay)
        self.draft = EWLeastSquares(4, decay)  # the draft phase ~ [s, s·B, C, s·[tree]]
        self.shape = shape
        self.observed = 0  # rounds observed (calibration points not counted)

    def _rest_x(self, batch: int, width: int, tree: bool = False) -> tuple[float, ...]:
        rows, q = self.shape(batch, width + 1)
        return (1.0, rows, rows * (q - 1), rows * (q > 1), float(tree))

    def add_calibration(self, batch: int, width: int, seconds: float) -> None:
        self.rest.add_fixed(self._rest_x(batch, width), seconds, CALIBRATION_WEIGHT)

    def add_step_calibration(self, batch: int, seconds: float, catch_up: int = 0) -> None:
        self.draft.add_fixed((1.0, batch, catch_up, 0.0), seconds, CALIBRATION_WEIGHT)

    def observe(self, batch, width, steps, rest_s, draft_s, catch_up=0, extra_rows=0, tree=False):
        self.observed += 1
        self.rest.update(self._rest_x(batch, width, tree), rest_s)
        if steps > 0:
            x = (steps, steps * batch + extra_rows, catch_up, steps * float(tree))
            self.draft.update(x, draft_s)

    def predict(self, batch, width, steps, catch_up=0, tree=False):
        t = self.rest.predict(self._rest_x(batch, width))
        if tree:  # a tree's own work, never priced below nothing (the fit may dip under 0)
            t += max(float(self.rest.theta[4]), 0.0)
        if steps > 0:
            d, e, g, h = self.draft.theta
            t += steps * max(d + e * batch, 0.0) + max(g, 0.0) * catch_up
            t += steps * max(h, 0.0) * tree
        return max(t, 1e-6)
