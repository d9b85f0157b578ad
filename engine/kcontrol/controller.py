"""Choosing the draft length K: for every request, every round, by expected goodput.

Terms (accepted, recovered, bonus, K) are defined in rejection.py; a request's acceptance rate α
and match rate m are estimated in engine/records/kstate.py; the round cost T(B, w) is measured
and fitted in cost.py (calibrated at start-up by calibration.py). This module is the policy alone.

The rule (:class:`AdaptiveK`)
-----------------------------
A row that drafts K tokens emits, on average, the accepted tokens plus one recovered/bonus token:
    E(α, K) = 1 + α + ... + α^K = (1 - α^(K+1)) / (1 - α)
and for a drafter that finds a draft only in a fraction m of rounds, E = 1 + m·(E(α, K) - 1).
The verify pads every row to the batch's widest draft w, so a round costs T(B, w) whatever each
row's own K. A round in which no row found a draft feeds one token per row whatever K was asked,
so with P = 1 - Π_i (1 - m_i), the chance that some row drafts, a round asked for w costs on
average
    T̄(B, w) = T(B, 0) + P·(T(B, w) - T(B, 0))
(P = 1 and m = 1 for a drafter that proposes whenever asked: one that samples, a draft model or
an EAGLE head, ``always_drafts``; its m is not estimated, whose prior would price its first
rounds as if half found no draft). The batch's width is the w in 0..K_max with the highest goodput
(emitted tokens per second),
    K* = argmax_w  Σ_i E(α_i, min(w, cap_i)) / T̄(B, w),
and row i drafts K_i = min(K*, cap_i) (cap_i: the request's k_max, its remaining tokens, the
context). K* = 0, plain decoding, unless some w beats it by the factor 1 + ``min_gain`` (a round
at K = 0 observes nothing, so near a tie drafting is worth more than its predicted goodput says).
Because T grows with B·w while the gain of a row does not, speculation shrinks and switches off
by itself as the batch grows, only where the measured costs say so.

When the decision is made
-------------------------
At the end of round r, from what round r measured: the commit loop hands each row to
:meth:`AdaptiveK.observe`, which updates α_i, m_i and records them with cap_i;
:meth:`AdaptiveK.end_round` feeds the round's times to the cost model, sums E(α_i, min(w, cap_i))
over the rows for every w (one array operation) and picks K* for round r + 1. A request that
joins at r + 1 takes that K*. Until the cost model is calibrated, K* = 0.

Probing
-------
Where K* = 0, a round now and then drafts anyway, to see whether drafting pays again
(:class:`~engine.kcontrol.probe.Prober`: spaced by their cost, rarer after probes that found
nothing).

Catch-up: a stateful drafter (a draft model, an EAGLE head) first takes in what its state missed,
Σ_i backlog_i positions beyond one a row (drafters/base.py ``backlogs``, read after each commit),
priced by the cost model (cost.py) and added once to T(B, w) for every w > 0, probes
included (``price_catch_up``). Where catching up a skipped round costs more than ``probe_budget``
of a round (a draft model, unbounded, at a large batch) no probe fits the budget and the batch
stays plain until rows with a shorter backlog replace it; an EAGLE head keeps < 2·WINDOW.

Reproducibility
---------------
K depends on measured times and on the batch, and the rejection rule consumes a sampled request's
random draws per K, so a seeded sampled request (temperature > 0 and a seed) runs at its fixed
``speculation.k`` if it sent one, else at K = 0 (:func:`pinned_k`), under every controller.
Greedy output is exact whatever K.

Other controllers behind the same interface: :class:`FixedK` (one K for every round) and
:class:`HeuristicK`, transformers' assisted-generation schedule (K += 2 after a round that accepted
every draft, else K -= 1, never below 1). Every controller returns 0 <= K <= cap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from engine.kcontrol.calibration import calibrate
from engine.kcontrol.cost import CostModel, RoundCost
from engine.kcontrol.probe import Prober
from engine.records.kstate import KState, leaf_reach

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner
    from engine.records.sequence import RoundStats, Sequence


def expected_tokens(alpha, match, ks: np.ndarray) -> np.ndarray:
    """E = 1 + m·(α + α² + ... + α^K) for each K in ``ks``: tokens one round emits on average
    (α, m scalars or arrays that broadcast against ``ks``; α -> 1 gives 1 + m·K to ~1e-9·K²)."""
    a = np.minimum(alpha, 1.0 - 1e-9)
    return 1.0 + match * a * (1.0 - a**ks) / (1.0 - a)


class KController:
    """Interface the engine drives: ``k_for`` in the plan loop, ``observe`` in the commit loop,
    ``end_round`` once after it; ``calibrate`` until ``calibrated``; ``price_shapes`` once."""

    name = "controller"
    calibrated = True  # AdaptiveK: False until its cost model was calibrated

    def price_shapes(self, shape: Callable[[int, int], tuple[int, int]]) -> None:
        """``shape(batch, q) -> (rows, q)``: the shape a target forward really runs (the fast
        path's buckets); a controller that prices rounds prices that shape."""

    def calibrate(
        self,
        target: ModelRunner,
        draft: ModelRunner | None,
        free_slots: list[int],
        invariant: bool = False,
    ) -> None:
        """Measure what the controller needs, using only ``free_slots`` and freeing them again
        (``invariant``: the target's forwards are the batch-invariant ones)."""

    def k_for(self, seq: Sequence, cap: int) -> int:
        """The row's K for this round, 0 <= K <= ``cap``."""
        raise NotImplementedError

    def leaves_for(self, seq: Sequence, k: int, cap: int) -> int:
        """Leaves of the row's draft tree beside its chain of ``k`` (round/draft_tree.py), 0 <=
        L <= ``cap``; 0: a chain. Asked only of rows that may grow one (``may_grow``)."""
        return 0

    def expects_drafts(self) -> bool:
        """Whether rows are likely to draft soon (False: a drafter may postpone what only
        drafting needs, drafters/base.py ``add``)."""
        return True

    def observe(self, seq: Sequence, k: int, stats: RoundStats, next_cap: int | None) -> None:
        """``next_cap``: the row's cap for the next round, None when it just finished."""

    def reset(self) -> None:
        """Forget what earlier rounds taught the policy (only between rounds, with no request
        held: a row's own record lives on its Sequence). A long-lived engine's tests call it so
        that whether a request drafts does not depend on what ran before it."""

    def end_round(
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
        """The round's rows, padded draft width and drafter's sequential steps, its measured
        times (the round without its draft phase, the draft phase), the positions beyond one
        a row its drafter took in first (Σ backlog_i of the drafting rows), the row-steps
        its draft steps ran beyond steps x rows (a draft tree's expansion) and whether some
        row was verified as a tree."""


def pinned_k(seq: Sequence, cap: int) -> int | None:
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

    def __init__(self, k: int, leaves: int = 0):
        self.k, self.leaves = k, leaves

    def k_for(self, seq, cap):
        pinned = pinned_k(seq, cap)
        return min(self.k, cap) if pinned is None else pinned

    def leaves_for(self, seq, k, cap):
        return min(self.leaves, cap) if k > 0 else 0

    def expects_drafts(self):
        return self.k > 0


class HeuristicK(KController):
    """transformers' "heuristic" schedule for assisted generation, per request."""

    name = "heuristic"

    def __init__(self, k_init: int, k_max: int):
        self.k_init, self.k_max = k_init, k_max

    def k_for(self, seq, cap):
        pinned = pinned_k(seq, cap)
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
        *,
        decay: float = 0.95,
        min_gain: float = 0.01,
        probe_interval: int = 2,
        probe_k: int = 2,
        probe_budget: float = 0.02,
        cost: CostModel | None = None,
        always_drafts: bool = False,
        price_catch_up: bool = True,
        max_leaves: int = 0,
        expand_rows: int = 0,
    ):
        self.k_max, self.decay, self.min_gain = k_max, decay, min_gain
        self.max_leaves = max_leaves  # a draft tree's most leaves (0: chains only)
        # head rows a tree row adds to each draft step after the first (EAGLE-2's expansion,
        # drafters/eagle/expand.py: its B - 1 extras); 0: a tree costs the drafter nothing
        self.expand_rows = expand_rows
        self.always_drafts = always_drafts  # m = 1: the drafter proposes whenever asked
        self.steps_per_width = steps_per_width  # drafter's sequential steps for a width w
        self.price_catch_up = price_catch_up  # False: fitted, not priced (a benchmark's mode)
        self.prober = Prober(probe_interval, min(probe_k, k_max), probe_budget)
        self.cost: CostModel = cost or RoundCost()
        self.widths = np.arange(k_max + 1)  # [K_max + 1] candidate widths w
        self.calibrated = cost is not None  # an injected cost model needs no calibration
        self._k_next: int | None = None  # K* for the next round
        self._leaves_next = 0  # L* for the next round's rows that may grow a tree
        self._reset_sums()

    def _reset_sums(self) -> None:
        # (α_i, m_i, cap_i, β_i) of the rows it decides; β_i = 0: the row may not grow a tree
        self._adaptive: list[tuple[float, float, int, float]] = []
        self._pinned_tokens = 0.0  # Σ_i E_i of the rows whose K is fixed
        self._rows = 0
        self._pinned_width = 0
        self._p_none = 1.0  # Π_i (1 - m_i): the chance that no row finds a draft
        self._states: list[KState] = []  # the adaptive rows': their backlog is read at _decide
        self._growable = 0  # the adaptive rows that may grow a tree

    # -- the engine's calls ---------------------------------------------------------------------
    def k_for(self, seq, cap):
        pinned = pinned_k(seq, cap)
        if pinned is not None:
            return pinned
        if self._k_next is None:  # nothing measured yet: decide for this row alone
            self._add_row(seq.kstate, None, cap, may_grow(seq))
            self._k_next = self._decide()
            self._reset_sums()
        return min(self._k_next, cap)

    def leaves_for(self, seq, k, cap):
        return min(self._leaves_next, cap) if k > 0 and pinned_k(seq, k) is None else 0

    def expects_drafts(self):
        return self._k_next is None or self._k_next > 0  # K* of the next round

    def observe(self, seq, k, stats, next_cap):
        st = seq.kstate
        chain = stats.accepted - stats.leaf_hit  # α is the chain's: a leaf is counted apart
        st.update(k, stats.drafted, chain, self.decay)
        st.update_leaves(stats.leaves, chain < stats.drafted, stats.leaf_hit > 0, self.decay)
        if next_cap is not None:
            self._add_row(st, pinned_k(seq, next_cap), next_cap, may_grow(seq))

    def _add_row(self, st: KState, pinned: int | None, cap: int, grows: bool = False) -> None:
        """Add one row to the batch sums that :meth:`_decide` weighs."""
        self._rows += 1
        match = 1.0 if self.always_drafts else st.match
        if pinned != 0:  # a row that will not draft never widens the verify
            self._p_none *= 1.0 - match
        if pinned is None:
            self._adaptive.append((st.alpha, match, cap, st.leaf_rate if grows else 0.0))
            self._growable += grows
            self._states.append(st)
        elif pinned == 0:
            self._pinned_tokens += 1.0
        else:
            self._pinned_tokens += float(expected_tokens(st.alpha, match, np.array(pinned)))
            self._pinned_width = max(self._pinned_width, pinned)

    def reset(self):
        """The next round decides as the first one did (from the row alone), and probing starts
        over (no backoff). The cost model is kept: its calibration and the rounds it fitted are
        this machine's measured speed, not requests' history."""
        self._k_next = None
        self._reset_sums()
        p = self.prober
        self.prober = Prober(p.interval, p.k, p.budget)

    def end_round(self, batch, width, steps, rest_s, draft_s, catch_up=0, extra_rows=0, tree=False):
        self.cost.observe(batch, width, steps, rest_s, draft_s, catch_up, extra_rows, tree)
        if self._rows:
            self._k_next = self._decide()
        self._reset_sums()

    def price_shapes(self, shape):
        self.cost.shape = shape

    def calibrate(self, target, draft, free_slots, invariant=False):
        """Start-up calibration of the cost model (the engine calls it until it could run)."""
        if free_slots:
            calibrate(self.cost, target, draft, free_slots, invariant=invariant, k_max=self.k_max)
            self.calibrated = True

    # -- the rule -------------------------------------------------------------------------------
    def _decide(self) -> int:
        """K* for the batch summed over ``_rows`` rows (0 until calibrated)."""
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
        backlog = sum(st.backlog for st in self._states) if self.price_catch_up else 0
        if backlog and self.k_max:  # a stateful drafter's catch-up, once, where adaptive rows draft
            w, steps = int(widths[1]), self.steps_per_width(int(widths[1]))
            catch_up = self.cost.predict(batch, w, steps, backlog)
            seconds[self.widths > 0] += catch_up - self.cost.predict(batch, w, steps)
        plain = self.cost.predict(batch, 0, 0)
        seconds = plain + (1.0 - self._p_none) * (seconds - plain)  # T̄: rounds without a draft
        tokens = np.full(len(widths), self._pinned_tokens)  # Σ_i E_i(min(w, cap_i)) per w
        if self._adaptive:  # every row at once: [rows, 1] against [rows, widths]
            a, m, cap, _ = (np.array(c)[:, None] for c in zip(*self._adaptive))
            tokens += expected_tokens(a, m, np.minimum(self.widths[None, :], cap)).sum(0)
        goodput = tokens / seconds
        best = int(np.argmax(goodput))
        if goodput[best] < goodput[0] * (1.0 + self.min_gain):
            best = 0
        self._leaves_next = 0
        if best and self.max_leaves:
            best = self._grow(batch, widths, seconds, tokens, best)
        decided = self.prober.decide(best, batch, seconds[self.prober.k] / seconds[0] - 1.0)
        if decided != best:  # a probe drafts a chain
            self._leaves_next = 0
        return decided

    def _grow(self, batch, widths, seconds, tokens, best: int) -> int:
        """Trees beside the chains (round/draft_tree.py): L leaves cost the verify L more
        queries, T(B, K + L) - T(B, K), a tree round's own work (cost.py: t and K·h), and with
        an expansion its extra head rows in K - 1 draft steps, and add to a row that may grow
        one the chance that a round whose chain was cut short ends at a leaf,
        m·(1 - α^K)·β·leaf_reach(L) (records/kstate.py):
        the (K, L) of best goodput with K + L <= K_max, where it beats the chains' ``best`` by
        the factor 1 + ``min_gain``. Sets ``_leaves_next``; returns K*."""
        a, m, cap, beta = (np.array(c) for c in zip(*self._adaptive))
        if not beta.any():
            return best
        predict = self.cost.predict
        rest = np.array([predict(batch, int(w), 0) for w in widths])  # the verify's part
        top, best_gp = best, tokens[best] / seconds[best] * (1.0 + self.min_gain)
        # per draft step (the cost model is linear in steps): what an expanding step's extra
        # head rows add, and the tree's own work, once a round and a step
        more = self.expand_rows * self._growable  # head rows an expanding step adds
        step = predict(batch, 0, 1) - predict(batch, 0, 0)
        more_step = predict(batch + more, 0, 1) - predict(batch + more, 0, 0) - step
        own = predict(batch, 0, 0, tree=True) - predict(batch, 0, 0)
        own_step = predict(batch, 0, 1, tree=True) - predict(batch, 0, 1) - own
        n = np.arange(1, self.max_leaves + 1)  # [L] leaves
        reach = np.array([leaf_reach(int(x)) for x in n])  # [L]
        for k in range(1, self.k_max):
            n_k = n[n <= self.k_max - k]  # the leaves a K of k leaves room for
            ks = np.minimum(k, cap)
            cut = m * (1.0 - np.minimum(a, 1.0) ** ks) * (ks > 0)  # [rows]
            gain = np.minimum((cut * beta)[:, None] * reach[None, : len(n_k)], 1.0).sum(0)
            tree_s = own + k * own_step + (k - 1) * more_step
            extra = (1.0 - self._p_none) * (rest[k + n_k] - rest[k] + tree_s)  # [L]
            gp = (tokens[k] + gain) / (seconds[k] + extra)
            i = int(np.argmax(gp))
            if gp[i] > best_gp:
                top, best_gp, self._leaves_next = k, float(gp[i]), int(n_k[i])
        return top


def may_grow(seq: Sequence) -> bool:
    """Whether a row may be verified as a tree: not under a grammar, penalties, logit bias,
    a min_tokens not yet reached or a bad word of several tokens (their processing reads a
    row's drafts as a chain: penalties.py, grammar.py, rules.py), nor seeded (a seeded row's
    draws follow its own K alone: plan.py) or deterministic (the batch-invariant forward
    verifies chains)."""
    p = seq.params
    short = len(seq.output_ids) < p.min_tokens
    return (
        seq.matcher is None
        and not p.penalized
        and not short
        and not p.multi_token_bad_words
        and p.seed is None
        and not p.deterministic
    )
