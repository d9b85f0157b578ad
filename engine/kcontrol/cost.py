"""The measured cost of one speculative round, T(B, w), and the fit behind it.

One round of a batch of B rows whose widest draft is w tokens costs
    T(B, w) = u·F(rows, q) + a + b·rows + c·rows·(q - 1) + f·rows·[q > 1] + t·[tree]
              + s(w)·(d + e·B + h·[tree]) + g·C
with (rows, q) the shape the verify forward really runs: every row padded to w + 1 query tokens
(the batch's widest draft sets the target's cost, not each row's own K), and both padded further
to the fast path's buckets where it has them (``ModelRunner.padded_shape``, given as ``shape``),
so widths that pad to one verify shape are priced alike.

- F(rows, q) is the target forward's own time at that shape, read off the start-up calibration
  (engine/kcontrol/calibration.py times one forward per bucketed shape the engine runs):
  exact at every timed shape, interpolated between them (:class:`ForwardTable`). A forward is
  not linear in its shape: on a CPU it is bound by reading the weights at a few rows x queries
  and by compute past that, so a line through narrow verifies prices a wide verify at a large
  batch far too cheap, and the controller drafts where a round loses to plain decoding.
- u (near 1) rescales the table as traffic runs (load, clocks); a + b·rows + c·rows·(q - 1) +
  f·rows·[q > 1] is the round's work beside the forward (sampling, the acceptance rule,
  bookkeeping), learned from the rounds themselves; f lets the first verified token cost other
  than each one after it.
- a round with draft trees (engine/round/draft_tree.py) pays its own host work beside the
  verify's extra queries (priced as the width they pad to): t, once a round, for growing the
  trees, the tree rule and laying the paths out as chains, and h a draft step for the head's
  runners-up; learned from the tree rounds themselves (0 until one was seen).
- the drafter runs s(w) sequential steps (the caller says how many) of d + e·B each, plus
  g·C for its catch-up: C positions beyond one a row, summed over the drafting rows, that a
  stateful drafter (a draft model, an EAGLE head) takes in first (drafters/base.py ``backlogs``):
  what its state missed while the row did not draft. A probe after a stretch at K = 0 pays it
  at once; a draft model's catch-up has no bound (every token it missed), so at a large batch
  a probe may cost more than the rounds it could save.

Fit: exponentially weighted least squares over every round's measured times: the round without its
draft phase on features [F, 1, rows, rows·(q - 1), rows·[q > 1], [tree]], weighted by relative
error (a 1 ms round counts as much as a 40 ms one), and the draft phase on [s, s·B, C, s·[tree]]
(s·B counting an expansion's extra head rows: drafters/eagle/expand.py). The calibration stays in
the fit as fixed pseudo-observations that never decay; a tiny ridge pulls the fit towards the
prior u = 1 and nothing else, which keeps it solvable before any data.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

CALIBRATION_WEIGHT = 0.5  # weight of one draft-step calibration point, in rounds
# the forward table's weight in the fit of the rest of a round, in rounds: spread over its
# points, so a finer calibration (more shapes) does not outweigh the rounds themselves
FORWARD_CALIBRATION_WEIGHT = 4.0
RIDGE = 1e-9  # pulls a fit towards its prior where the data leave a direction free

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


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs increasing), extended past either end along its
    last segment, never falling below its end point (a forward is no cheaper for being larger)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x > xs[-1]:
        return max(y, ys[-1])
    if x < xs[0]:
        return min(y, ys[0])
    return y


class ForwardTable:
    """F(rows, q): the target forward's measured seconds at each timed (rows, q), the mean of
    its timings; between timed shapes, piecewise-linear over rows at each timed q, then over q
    (the engine's shapes are the timed ones: interpolation serves a model without buckets). 0
    before anything was timed."""

    def __init__(self) -> None:
        self._times: dict[tuple[int, int], list[float]] = {}
        # F by shape, read once: the controller prices the same few padded shapes every round
        self._memo: dict[tuple[int, int], float] = {}

    def __len__(self) -> int:
        return len(self._times)

    def add(self, rows: int, q: int, seconds: float) -> None:
        self._times.setdefault((rows, q), []).append(seconds)
        self._memo.clear()

    def points(self) -> list[tuple[int, int, float]]:
        """(rows, q, mean seconds) of every timed shape."""
        return [(r, q, sum(t) / len(t)) for (r, q), t in sorted(self._times.items())]

    def __call__(self, rows: int, q: int) -> float:
        if (rows, q) not in self._memo:
            self._memo[(rows, q)] = self._interpolate(rows, q)
        return self._memo[(rows, q)]

    def _interpolate(self, rows: int, q: int) -> float:
        if not self._times:
            return 0.0
        by_q: dict[int, tuple[list[float], list[float]]] = {}
        for r, qq, s in self.points():
            xs, ys = by_q.setdefault(qq, ([], []))
            xs.append(r)
            ys.append(s)
        qs = sorted(by_q)
        return _interp(qs, [_interp(*by_q[qq], rows) for qq in qs], q)


class EWLeastSquares:
    """y ≈ θ·x by exponentially weighted least squares, plus fixed pseudo-observations (the
    start-up calibration) that never decay, and a tiny ridge towards ``prior`` (default 0)."""

    def __init__(self, dim: int, decay: float, prior=None):
        self.decay = decay
        self.prior = np.zeros(dim) if prior is None else np.asarray(prior, dtype=float)
        self.a = np.zeros((dim, dim))
        self.b = np.zeros(dim)
        self.clear_fixed()

    def clear_fixed(self) -> None:
        """Forget the fixed pseudo-observations (to add them anew)."""
        dim = len(self.prior)
        self.a_fixed = np.eye(dim) * RIDGE
        self.b_fixed = self.prior * RIDGE
        self._theta: np.ndarray | None = None

    def add_fixed(self, x, y: float, weight: float) -> None:
        x = np.asarray(x, dtype=float)
        self.a_fixed += weight * np.outer(x, x)
        self.b_fixed += weight * x * y
        self._theta = None

    def update(self, x, y: float, weight: float = 1.0) -> None:
        x = np.asarray(x, dtype=float)
        self.a = self.decay * self.a + weight * np.outer(x, x)
        self.b = self.decay * self.b + weight * x * y
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
        self.forward = ForwardTable()  # F: the timed target forwards
        # round minus draft phase ~ [F, 1, rows, rows·(q-1), rows·[q>1], [tree]]; prior: F alone
        self.rest = EWLeastSquares(6, decay, prior=(1.0, 0, 0, 0, 0, 0))
        self.draft = EWLeastSquares(4, decay)  # the draft phase ~ [s, s·B, C, s·[tree]]
        self.shape = shape
        self.observed = 0  # rounds observed (calibration points not counted)

    def _rest_x(self, batch: int, width: int, tree: bool = False) -> tuple[float, ...]:
        rows, q = self.shape(batch, width + 1)
        return (self.forward(rows, q), 1.0, rows, rows * (q - 1), rows * (q > 1), float(tree))

    def add_calibration(self, batch: int, width: int, seconds: float) -> None:
        rows, q = self.shape(batch, width + 1)
        self.forward.add(rows, q, seconds)
        # the table's points, anew: each one's F is now its mean, and they share one weight
        self.rest.clear_fixed()
        points = self.forward.points()
        for r, qq, s in points:
            x = (s, 1.0, r, r * (qq - 1), r * (qq > 1), 0.0)
            self.rest.add_fixed(x, s, FORWARD_CALIBRATION_WEIGHT / len(points) / max(s, 1e-9) ** 2)

    def add_step_calibration(self, batch: int, seconds: float, catch_up: int = 0) -> None:
        self.draft.add_fixed((1.0, batch, catch_up, 0.0), seconds, CALIBRATION_WEIGHT)

    def observe(self, batch, width, steps, rest_s, draft_s, catch_up=0, extra_rows=0, tree=False):
        self.observed += 1
        # weighted by relative error: the fit's unit is a round's share, whatever its size
        self.rest.update(self._rest_x(batch, width, tree), rest_s, 1.0 / max(rest_s, 1e-6) ** 2)
        if steps > 0:
            x = (steps, steps * batch + extra_rows, catch_up, steps * float(tree))
            self.draft.update(x, draft_s)

    def predict(self, batch, width, steps, catch_up=0, tree=False):
        t = self.rest.predict(self._rest_x(batch, width))
        if tree:  # a tree's own work, never priced below nothing (the fit may dip under 0)
            t += max(float(self.rest.theta[5]), 0.0)
        if steps > 0:
            d, e, g, h = self.draft.theta
            t += steps * max(d + e * batch, 0.0) + max(g, 0.0) * catch_up
            t += steps * max(h, 0.0) * tree
        return max(t, 1e-6)
