"""Choosing the draft length K: for every request, every round, by expected goodput.

Terms (accepted, recovered, bonus, K) are defined in rejection.py. Here α is a request's
per-token acceptance rate: the probability that a drafted token is accepted given that every
drafted token before it in the round was.

The rule (:class:`AdaptiveK`)
-----------------------------
A row that drafts K tokens emits, on average, the accepted tokens plus one recovered/bonus token:
    E(α, K) = 1 + α + ... + α^K = (1 - α^(K+1)) / (1 - α)
For a drafter that finds a draft only in a fraction m of rounds (n-gram lookup without a match
drafts nothing), E = 1 + m·(E(α, K) - 1).
One round of a batch of B rows whose widest draft is w tokens costs
    T(B, w) = a + b·B + c·B·w  +  s(w)·(d + e·B)
- the verify forward pads every row to w + 1 query tokens, so the target's cost (with the
  round's sampling and bookkeeping, a + b·B + c·B·w) is set by the batch's widest draft, not by
  each row's own K; on the fast path (fast_forward.py) B and w + 1 are further padded to its
  batch and q buckets, and T takes the padded values (ModelRunner.padded_shape): widths that pad
  to one verify shape cost the target the same;
- the drafter runs s(w) sequential steps (w for a draft model, one lookup for n-gram, 0 at w = 0)
  of d + e·B each.
A round in which no row found a draft feeds one token per row whatever K was asked, so with
P = 1 - Π_i (1 - m_i), the chance that some row drafts, a round asked for w costs on average
    T̄(B, w) = T(B, 0) + P·(T(B, w) - T(B, 0))
(P = 1 for a draft model). The batch's width is the w in 0..K_max with the highest goodput
(emitted tokens per second),
    K* = argmax_w  Σ_i E(α_i, min(w, cap_i)) / T̄(B, w),
and row i drafts K_i = min(K*, cap_i) (cap_i: the request's k_max, its remaining tokens, the
context). K* = 0, plain decoding, unless some w beats it by ``min_gain`` (1%: a round at K = 0
observes nothing, so near a tie drafting is worth more than its predicted goodput says; replaying
real n-gram traces, loadtest/replay_k.py, 3% gave 1% less throughput). Because T grows with B·w
while the gain of a row does not, speculation shrinks and switches off by itself as the batch
grows, and only where the measured costs say so: no batch-size table.

Estimates, all measured
-----------------------
- α_i: exponentially weighted counts over the request's own rounds. A round that drafted n tokens
  and accepted a adds a successes and, when a < n, one failure (the maximum-likelihood estimate of
  a geometric run), after decaying the old counts by ``decay`` per drafted token (a memory of about
  1 / (1 - decay) drafted tokens, whatever K was): α = (S + α0·w0) / (S + F + w0), a weak prior α0
  of weight w0. m_i likewise, per round, over the rounds in which the row asked for K > 0.
- T: exponentially weighted least squares over every round's measured times: the round without
  its draft phase on features [1, B, B·w], the draft phase per step on [1, B]. A start-up
  calibration (timed forwards of the target and the draft model at a few (B, w), see
  :func:`calibrate`) stays in the fit as fixed pseudo-observations, so the slope c is known before
  traffic has ever varied w, and the fit never becomes singular.

When the decision is made
-------------------------
At the end of round r, from what round r measured: the commit loop hands each row to
:meth:`AdaptiveK.observe`, which updates α_i, m_i and adds E(α_i, min(w, cap_i)) for every w to a
per-batch sum; :meth:`AdaptiveK.end_round` then picks K* for round r + 1. A request that joins at
r + 1 takes that K*. So the engine keeps a single loop over the batch per round.

Probing
-------
At K* = 0 nothing is observed and α could never recover when the text turns predictable. After
``probe_interval`` rounds at K* = 0, one round drafts ``probe_k`` tokens for every adaptive row.
For n-gram rows without a match that costs nothing (the verify pads to the longest draft found).
Where a probe round costs more than ``probe_budget`` of the rounds between two probes (a large
batch on a machine where verifying costs), probes are spaced further apart to keep within it.

Reproducibility
---------------
K depends on measured times and on the batch, and the rejection rule consumes a sampled request's
random draws per K, so a seeded sampled request (temperature > 0 and a seed) would not reproduce
under adaptive K. Such a request runs at its fixed ``speculation.k`` if it sent one, else at K = 0:
reproducibility first. Greedy output is exact whatever K.

Other controllers behind the same interface: :class:`FixedK` (one K for every round) and
:class:`HeuristicK`, transformers' assisted-generation schedule (K += 2 after a round that accepted
every draft, else K -= 1, never below 1), kept for comparison in loadtest/bench_adaptive.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .sequence import RoundStats, Sequence

# prior of a new request's acceptance rate and match rate, and their weights in tokens / rounds
ALPHA_PRIOR, ALPHA_PRIOR_WEIGHT = 0.5, 1.0
MATCH_PRIOR, MATCH_PRIOR_WEIGHT = 0.5, 1.0
CALIBRATION_WEIGHT = 0.5  # weight of one calibration point, in rounds


@dataclass
class KState:
    """A request's own speculation history, kept on its Sequence and updated by the controller."""

    acc: float = 0.0  # decayed accepted drafted tokens
    rej: float = 0.0  # decayed rejection events
    matched: float = 0.0  # decayed rounds with K > 0 in which the drafter proposed something
    asked: float = 0.0  # decayed rounds with K > 0
    heuristic_k: int | None = None  # HeuristicK's current K

    @property
    def alpha(self) -> float:
        return (self.acc + ALPHA_PRIOR * ALPHA_PRIOR_WEIGHT) / (
            self.acc + self.rej + ALPHA_PRIOR_WEIGHT
        )

    @property
    def match(self) -> float:
        return (self.matched + MATCH_PRIOR * MATCH_PRIOR_WEIGHT) / (self.asked + MATCH_PRIOR_WEIGHT)

    def update(self, asked_k: int, drafted: int, accepted: int, decay: float) -> None:
        if asked_k <= 0:
            return
        self.matched = decay * self.matched + (drafted > 0)
        self.asked = decay * self.asked + 1.0
        if drafted > 0:
            forget = decay**drafted  # per drafted token: a round of 8 weighs like 8 rounds of 1
            self.acc = forget * self.acc + accepted
            self.rej = forget * self.rej + (accepted < drafted)


def expected_tokens(alpha: float, match: float, ks: np.ndarray) -> np.ndarray:
    """E = 1 + m·(α + α² + ... + α^K) for each K in ``ks``: tokens one round emits on average."""
    if alpha >= 1.0 - 1e-9:
        return 1.0 + match * ks
    return 1.0 + match * alpha * (1.0 - alpha**ks) / (1.0 - alpha)


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
    """The measured cost model T(B, w) of one round (see the module docstring).

    ``shape(batch, q) -> (rows, q)``: the shape a target forward really runs (the fast path pads
    to buckets, ModelRunner.padded_shape); B and w enter the features padded, so every draft
    width that pads to the same verify shape is priced alike."""

    def __init__(self, decay: float = 0.98, shape=_unpadded):
        self.rest = EWLeastSquares(3, decay)  # round minus draft phase ~ [1, B, B·w]
        self.step = EWLeastSquares(2, decay)  # one draft step ~ [1, B]
        self.shape = shape
        self.observed = 0

    def _rest_x(self, batch, width):
        rows, q = self.shape(batch, width + 1)
        return (1.0, rows, rows * (q - 1))

    def add_calibration(self, batch: int, width: int, seconds: float) -> None:
        self.rest.add_fixed(self._rest_x(batch, width), seconds, CALIBRATION_WEIGHT)

    def add_step_calibration(self, batch: int, seconds: float) -> None:
        self.step.add_fixed((1.0, batch), seconds, CALIBRATION_WEIGHT)

    def observe(self, batch: int, width: int, steps: int, rest_s: float, draft_s: float) -> None:
        self.observed += 1
        self.rest.update(self._rest_x(batch, width), rest_s)
        if steps > 0:
            self.step.update((1.0, batch), draft_s / steps)

    def predict(self, batch: int, width: int, steps: int) -> float:
        t = self.rest.predict(self._rest_x(batch, width))
        if steps > 0:
            t += steps * max(self.step.predict((1.0, batch)), 0.0)
        return max(t, 1e-6)


class KController:
    """Interface the engine drives: ``k_for`` in the plan loop, ``observe`` in the commit loop,
    ``end_round`` once after it."""

    name = "controller"
    calibrated = True  # AdaptiveK: False until its cost model was calibrated

    def calibrate(self, target, draft, free_slots: list[int]) -> None:
        pass

    def k_for(self, seq: Sequence, cap: int) -> int:
        raise NotImplementedError

    def observe(self, seq: Sequence, k: int, stats: RoundStats, next_cap: int | None) -> None:
        """``next_cap``: the row's cap for the next round, None when it just finished."""

    def end_round(self, batch: int, width: int, steps: int, rest_s: float, draft_s: float) -> None:
        """The round's rows, padded draft width and drafter's sequential steps, and its measured
        times (the round without its draft phase, the draft phase)."""


def _pinned_k(seq: Sequence, cap: int) -> int | None:
    """K fixed by the request itself (or forced to 0), else None (the controller decides)."""
    if cap <= 0:
        return 0
    if seq.spec.k is not None:
        return min(seq.spec.k, cap)
    if not seq.params.greedy and seq.params.seed is not None:
        return 0  # seeded sampling must reproduce: no K that depends on time or load
    return None


class FixedK(KController):
    name = "fixed"

    def __init__(self, k: int):
        self.k = k

    def k_for(self, seq, cap):
        pinned = _pinned_k(seq, cap)
        return min(self.k, cap) if pinned is None else pinned


class HeuristicK(KController):
    """transformers' "heuristic" schedule for assisted generation, per request."""

    name = "heuristic"

    def __init__(self, k_init: int, k_max: int):
        self.k_init, self.k_max = k_init, k_max

    def k_for(self, seq, cap):
        pinned = _pinned_k(seq, cap)
        if pinned is not None:
            return pinned
        if seq.kstate.heuristic_k is None:
            seq.kstate.heuristic_k = self.k_init
        return min(seq.kstate.heuristic_k, cap)

    def observe(self, seq, k, stats, next_cap):
        st = seq.kstate
        if st.heuristic_k is None or k <= 0 or stats.drafted <= 0:
            return
        if stats.accepted == stats.drafted:
            st.heuristic_k = min(st.heuristic_k + 2, self.k_max)
        else:
            st.heuristic_k = max(1, st.heuristic_k - 1)


class AdaptiveK(KController):
    """The goodput rule of the module docstring."""

    name = "adaptive"

    def __init__(
        self,
        k_max: int,
        steps_per_width=lambda w: w,
        decay: float = 0.95,
        min_gain: float = 0.01,
        probe_interval: int = 2,
        probe_k: int = 2,
        probe_budget: float = 0.02,
        cost: RoundCost | None = None,
    ):
        self.k_max, self.decay, self.min_gain = k_max, decay, min_gain
        self.steps_per_width = steps_per_width  # drafter's sequential steps for a width w
        self.probe_interval, self.probe_k, self.probe_budget = probe_interval, probe_k, probe_budget
        self.cost = cost or RoundCost()
        self.widths = np.arange(k_max + 1)  # [K_max + 1] candidate widths w
        self.calibrated = cost is not None  # an injected cost model needs no calibration
        self._k_next: int | None = None  # K* for the next round
        self._zero_rounds = 0
        self._reset_sums()

    def _reset_sums(self) -> None:
        self._tokens = np.zeros(self.k_max + 1)  # Σ_i E_i(min(w, cap_i)) per candidate w
        self._rows = 0
        self._pinned_width = 0
        self._p_none = 1.0  # Π_i (1 - m_i): the chance that no row finds a draft

    # -- the engine's calls ---------------------------------------------------------------------
    def k_for(self, seq, cap):
        pinned = _pinned_k(seq, cap)
        if pinned is not None:
            return pinned
        if self._k_next is None:  # nothing measured yet: decide for this row alone
            self._add_row(seq.kstate, None, cap)
            self._k_next = self._decide()
            self._reset_sums()
        return min(self._k_next, cap)

    def observe(self, seq, k, stats, next_cap):
        st = seq.kstate
        st.update(k, stats.drafted, stats.accepted, self.decay)
        if next_cap is not None:
            self._add_row(st, _pinned_k(seq, next_cap), next_cap)

    def _add_row(self, st: KState, pinned: int | None, cap: int) -> None:
        """Add one row to the batch sums that :meth:`_decide` weighs."""
        self._rows += 1
        if pinned != 0:  # a row that will not draft never widens the verify
            self._p_none *= 1.0 - st.match
        if pinned is None:
            self._tokens += expected_tokens(st.alpha, st.match, np.minimum(self.widths, cap))
        else:
            self._tokens += expected_tokens(st.alpha, st.match, np.array([pinned]))[0]
            self._pinned_width = max(self._pinned_width, pinned)

    def end_round(self, batch, width, steps, rest_s, draft_s):
        self.cost.observe(batch, width, steps, rest_s, draft_s)
        if self._rows:
            self._k_next = self._decide()
        self._reset_sums()

    def calibrate(self, target, draft, free_slots: list[int]) -> None:
        """Start-up calibration of the cost model (the engine calls it until it could run)."""
        if free_slots:
            calibrate(self.cost, target, draft, free_slots)
            self.calibrated = True

    # -- the rule -------------------------------------------------------------------------------
    def _decide(self) -> int:
        """K* for the batch summed into ``_tokens`` over ``_rows`` rows (0 until calibrated)."""
        if not self.calibrated:
            return 0
        batch = self._rows
        widths = np.maximum(self.widths, self._pinned_width)
        seconds = np.array(
            [
                self.cost.predict(batch, int(w), self.steps_per_width(int(w)) if w else 0)
                for w in widths
            ]
        )
        plain = self.cost.predict(batch, 0, 0)
        seconds = plain + (1.0 - self._p_none) * (seconds - plain)  # T̄: rounds without a draft
        goodput = self._tokens / seconds
        best = int(np.argmax(goodput))
        if goodput[best] < goodput[0] * (1.0 + self.min_gain):
            best = 0
        if best == 0:
            self._zero_rounds += 1
            probe = min(self.probe_k, self.k_max)
            # probe at most every probe_interval rounds, and rarer when a probe round costs more
            # than probe_budget of the rounds between two probes (large batches)
            extra = seconds[probe] / seconds[0] - 1.0
            if self._zero_rounds >= max(self.probe_interval, extra / self.probe_budget):
                self._zero_rounds = 0
                best = probe
        else:
            self._zero_rounds = 0
        return best


def calibrate(
    cost: RoundCost,
    target,
    draft=None,
    free_slots: list[int] = (),
    prefix: int = 32,
    widths=(0, 2, 6),
    repeats: int = 2,
) -> None:
    """Time the target's forward at a few (B, w) (B = 1 and up to 4 free slots; w + 1 query
    tokens after a ``prefix``-token context) and the draft model's one-token step, and add them
    to ``cost`` as fixed pseudo-observations. Uses only ``free_slots`` and frees them again."""
    slots = list(free_slots)[:4]
    room = min(r.max_len for r in [target] + ([draft] if draft is not None else []))
    widths = [w for w in widths if w + 2 <= room]
    prefix = max(1, min(prefix, room - max(widths) - 1))
    if not slots:
        return
    runners = [target] + ([draft] if draft is not None else [])
    for r in runners:
        for s in slots:
            r.cache.allocate(s)
    try:
        for r in runners:
            for s in slots:
                r.forward([[1] * prefix], [s])  # context to attend to
                r.cache.commit(s, prefix)
        batches = sorted({1, len(slots)})

        def timed(runner, batch, q):
            best = math.inf
            for _ in range(repeats + 1):  # the first run warms up
                t0 = time.perf_counter()
                runner.forward([[1] * q for _ in range(batch)], slots[:batch], logits="all")
                best = min(best, time.perf_counter() - t0)
            return best

        for b in batches:
            for w in widths:
                cost.add_calibration(b, w, timed(target, b, w + 1))
            if draft is not None:
                cost.add_step_calibration(b, timed(draft, b, 1))
    finally:
        for r in runners:
            for s in slots:
                r.cache.free(s)
