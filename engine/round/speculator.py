"""One speculative round for every running sequence at once, top to bottom:

  1. plan     -- each row's K (capped by its remaining tokens and the context), sampling params
                 and random draws (plan.py): host decisions only.
  2. propose  -- the drafter proposes up to K_i tokens per row (ragged rows, padded to the widest);
                 a row whose grammar forces its next tokens drafts those instead (forced.py).
  3. verify   -- one target forward over [last token, d_1..d_K_i] of every row; logit bias,
                 penalties (penalties.py) and grammar masks (grammar.py) at position i count
                 d_1..d_i as output.
  4. accept   -- the exact rejection rule (rejection.py defines accepted, recovered and bonus
                 tokens, and K); the round's one device->host sync reads its result (output.py)
                 (rows with a grammar read their drafts once before: grammar.py).
  5. commit   -- append the emitted tokens (cut at stop conditions), commit the target cache to
                 ``len(tokens) - 1`` and roll the drafter's state back to what was kept.

K_i comes from the controller (kcontrol/controller.py) or a forced run: ``k_for`` in the plan,
``observe`` in the commit loop (with K = 0 for a forced row: the grammar's drafts say nothing of the
drafter), ``end_round`` with the round's measured times. Drafter faults make a plain round for
their rows (drafters/guard.py). The first token of a sequence is sampled from its prefill's
logits by :meth:`Speculator.first_tokens`, the same rule with K = 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.drafters.forced import forced_run, with_forced
from engine.drafters.guard import GuardedDrafter
from engine.kcontrol.controller import KController, may_grow
from engine.kcontrol.timing import PhaseClock
from engine.model.runner import ModelRunner
from engine.records.output import StepOutput
from engine.records.plan import RoundPlan
from engine.records.sequence import RoundStats, Sequence, Status
from engine.requests.scheduler import Scheduler
from engine.round.draft_tree import grow, settle
from engine.round.output import make_output, to_host
from engine.round.penalties import apply_penalties
from engine.round.plan import make_plan
from engine.round.rejection import rejection_sample
from engine.round.rules import apply_rules
from engine.round.tree import tree_accept
from engine.sampling.grammar import advance, apply_grammar
from engine.sampling.probs import logits_to_probs
from engine.transfer import to_device

AcceptRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # rejection_sample's signature


class Speculator:
    """Runs rounds over a target, a (guarded) drafter and a K controller."""

    def __init__(
        self,
        target: ModelRunner,
        drafter: GuardedDrafter | None,
        controller: KController,
        scheduler: Scheduler,
        k_max: int,
        rng: torch.Generator,
        accept: AcceptRule = rejection_sample,
    ):
        self.target, self.drafter, self.controller = target, drafter, controller
        self.scheduler, self.k_max, self.rng = scheduler, k_max, rng
        self.device, self.vocab_size = target.device, target.vocab_size
        self.accept = accept  # the acceptance rule: the exact one unless a benchmark's

    def round(self, seqs: list[Sequence], invariant: bool = False) -> list[StepOutput]:
        """One speculative round over the running rows ``seqs`` (``invariant``: the target's
        verify is the batch-invariant forward of deterministic mode)."""
        t_start = time.perf_counter()
        # 1. plan: a row the grammar forces drafts its forced run (forced.py), the others ask
        # the controller for K; K_i of the plan is the run's length or the K asked
        caps = [self.k_cap(s) for s in seqs]
        forced = [forced_run(s, cap) for s, cap in zip(seqs, caps)]
        asked = [0 if f else self.controller.k_for(s, cap) for s, cap, f in zip(seqs, caps, forced)]
        plan = self._plan(seqs, [len(f) or k for f, k in zip(forced, asked)])
        leaves = self._leaves(seqs, asked, plan.ks, invariant)  # a tree's leaves per row
        plan.leaves = leaves
        # 2. propose
        clock = PhaseClock(self.device)  # the draft and verify phases' device time
        clock.mark()
        prop, catch_up = None, 0  # catch_up: positions beyond one a row the drafter takes in first
        if self.drafter is not None and any(asked):
            catch_up = sum(s.kstate.backlog for s, k in zip(seqs, asked) if k)
            prop = self.drafter.propose(seqs, replace(plan, ks=asked))
        if prop is not None:
            drafts, num_draft, draft_probs = prop.tokens, prop.num, prop.probs  # [batch, K]
        else:
            drafts = torch.zeros(len(seqs), 0, dtype=torch.long, device=self.device)
            num_draft, draft_probs = [0] * len(seqs), None
        if any(forced):
            drafts, num_draft, draft_probs = with_forced(drafts, num_draft, draft_probs, forced)
        kmax = drafts.shape[1]
        clock.mark()  # (a tree's growing is its verify's work: the cost model prices it so)
        tree = None  # the round's draft trees (draft_tree.py), where some row grows one
        if prop is not None and prop.alternatives is not None and kmax:
            leaves = [n_l if n else 0 for n_l, n in zip(leaves, num_draft)]
            sizes = prop.alternatives.sizes  # (no verify query for a candidate that is none)
            if sizes is not None:
                leaves = [min(n_l, c) for n_l, c in zip(leaves, sizes)]
            if any(leaves):
                tree = grow(drafts, num_draft, draft_probs, prop.alternatives, leaves)
        if tree is None:  # chains only (no row drafted runners-up: a fault, n-gram, forced)
            leaves = [0] * len(seqs)
        # 3. verify: one target pass over [last token, d_1..d_K] per row, or its tree's nodes
        nodes = tree.tokens if tree is not None else drafts  # [batch, n]
        verify_ids = torch.cat([plan.last, nodes], dim=1)  # [batch, n+1]
        counts = [1 + (nodes.shape[1] if n_l else n) for n_l, n in zip(leaves, num_draft)]
        slots = [s.slot for s in seqs]
        shape = tree.tree if tree is not None else None  # (else causal: a chain)
        fwd = self.target.forward(verify_ids, slots, counts, "all", invariant, shape)
        logits, tapped = fwd.logits, fwd.tapped
        logits = self._process(logits, seqs, nodes, num_draft)  # [batch, n+1, vocab]
        top_n = self._top_n(seqs)
        probs = self._probs(logits, plan, top_n)  # [batch, n+1, vocab]
        clock.mark()
        tv = time.perf_counter()  # (on CUDA the verify kernels may still run: they end in 4's sync)
        # 4. accept, and the round's one device->host sync
        starts = [s.num_tokens - 1 for s in seqs]  # each row's verify starts at its last token
        tree_stats = None  # a tree round's leaves and leaf hits per row (draft_tree.settle)
        path_probs: torch.Tensor | None = probs  # [batch, K+1, vocab] at the emitted positions
        uniforms = plan.uniforms[:, :kmax]
        if tree is None:
            num_t = to_device(num_draft, torch.long, self.device)
            num_acc, next_tok = self.accept(
                probs, drafts, num_t, draft_probs, plan.greedy, uniforms, plan.noise
            )
        else:  # the tree rule; the accepted paths laid out as chains (draft_tree.py)
            if plan.noise is not None:  # the leaves' draws: tree rows are never seeded
                more = nodes.shape[1] - kmax
                leaf_u = torch.rand(len(seqs), more, generator=self.rng, device=self.device)
                uniforms = torch.cat([uniforms, leaf_u], dim=1)
            # every row greedy or trying its candidates as point masses: the rule in closed form
            rows_point = tree.point_rows or [False] * len(seqs)
            every_point = all(p.greedy or x for p, x in zip(plan.params, rows_point))
            path, num_acc, next_tok = tree_accept(
                probs, nodes, tree.parents, tree.valid, tree.q, plan.greedy, uniforms, plan.noise,
                depth=kmax, width=tree.width, point=tree.point, every_point=every_point,
                anc=tree.node_ancestors,
            )  # fmt: skip
            cache = self.target.cache
            st = settle(
                tree,
                path,
                num_acc,
                probs,
                tapped,
                cache,
                slots,
                starts,
                want_probs=top_n is not None,
            )
            drafts, path_probs, tapped, tree_stats = st
        if self.drafter is not None:  # the target's features of the kept layout (EAGLE-3)
            self.drafter.observe(seqs, tapped, starts, [n + 1 for n in num_draft])
        rows = to_host(path_probs, drafts, num_acc, next_tok, top_n, tree_stats)
        t2 = time.perf_counter()
        draft_s, verify_s = clock.seconds(0, 1), clock.seconds(1, 2)  # (read after the sync)
        # 5. commit / rollback
        outputs = []
        copied_rows = {b for b, c in enumerate(prop.copied or []) if c} if prop else set()
        for b, (s, k, n, f, row) in enumerate(zip(seqs, asked, num_draft, forced, rows)):
            kept = row.accepted
            # a forced run is the grammar's draft, not the drafter's: counted apart
            nd, a, free = (0, 0, kept) if f else (n, kept, 0)
            s.drafted, s.accepted, s.target_passes = (
                s.drafted + nd,
                s.accepted + a,
                s.target_passes + 1,
            )
            emitted = self.scheduler.postprocess(s, row.drafts[:kept] + [row.next_token])
            advance(s, emitted)
            # leaves: those verified (the ones asked, where the drafter had runners-up)
            stats = RoundStats(
                k, nd, a, len(emitted), draft_s, verify_s, kmax, t2 - tv, free, row.leaves,
                row.leaf_hit, copied=nd > 0 and b in copied_rows,
            )  # fmt: skip
            s.tree_rounds += row.leaves > 0
            s.leaf_hits += row.leaf_hit
            next_cap = self.k_cap(s) if s.status is Status.RUNNING else None
            self.controller.observe(s, k, stats, next_cap)
            outputs.append(make_output(s, emitted, stats, row))
        if self.drafter is not None:
            live = [s for s in seqs if s.status is Status.RUNNING and s.spec.enabled]
            self.drafter.commit(live)
            self._note_backlogs(live)
        t3 = time.perf_counter()
        width = max(asked)  # the drafter's own steps: forced runs cost it none
        steps = self.drafter.inner.steps(width) if self.drafter is not None and width else 0
        rest_s = (t3 - t_start) - draft_s
        extra = prop.extra_rows if prop is not None else 0  # a tree's expansion's head rows
        self.controller.end_round(
            len(seqs), kmax, steps, rest_s, draft_s, catch_up, extra, tree is not None
        )
        return outputs

    def _leaves(
        self, seqs: list[Sequence], asked: list[int], ks: list[int], invariant: bool
    ) -> list[int]:
        """Each row's draft-tree leaves (0: a chain): asked of the controller for the rows that
        draft and may grow one, within the verify's widest shape (K_max + 1 queries: the
        compiled shapes and the KV budget's lookahead) and the context."""
        widest = max(ks + [0])
        if invariant or not widest or self.drafter is None or not self.drafter.inner.trees:
            return [0] * len(seqs)
        room = self.k_max - widest  # leaf columns follow the widest chain's
        out = []
        for s, k in zip(seqs, asked):
            cap = min(room, self.target.max_len - s.num_tokens - widest)
            ok = k > 0 and cap > 0 and may_grow(s)
            out.append(self.controller.leaves_for(s, k, cap) if ok else 0)
        return out

    def _note_backlogs(self, seqs: list[Sequence]) -> None:
        """Each row's drafter backlog, read once its drafter state changed (kcontrol/controller.py
        prices the catch-up; the next round sums it over its drafting rows)."""
        assert self.drafter is not None
        for s, n in zip(seqs, self.drafter.backlogs(seqs)):
            s.kstate.backlog = n

    def first_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Sample each new sequence's first token from its prefill's last logits [new, vocab]."""
        if self.drafter is not None:
            self.drafter.add(seqs, lazy=not self.controller.expects_drafts())
            self._note_backlogs([s for s in seqs if s.spec.enabled])
        plan = self._plan(seqs, [0] * len(seqs))
        empty = torch.zeros(len(seqs), 0, dtype=torch.long, device=self.device)
        logits = self._process(logits[:, None], seqs, empty, [0] * len(seqs))  # [new, 1, vocab]
        top_n = self._top_n(seqs)
        probs = self._probs(logits, plan, top_n)
        num_acc, next_tok = rejection_sample(
            probs, empty, plan.num_zero, None, plan.greedy, plan.uniforms, plan.noise
        )
        rows = to_host(probs, empty, num_acc, next_tok, top_n)  # the one sync
        outputs = []
        for s, row in zip(seqs, rows):
            s.target_passes += 1
            emitted = self.scheduler.postprocess(s, [row.next_token])
            advance(s, emitted)
            outputs.append(make_output(s, emitted, None, row))
        return outputs

    def k_cap(self, s: Sequence) -> int:
        """The most a row may draft: its k_max, and never past max_tokens (a round emits at most
        K + 1) or the context."""
        if self.drafter is None or not s.spec.enabled:
            return 0
        k_max = min(s.spec.k_max, self.k_max) if s.spec.k_max is not None else self.k_max
        return max(0, min(k_max, s.remaining - 1, self.target.max_len - s.num_tokens))

    def _plan(self, seqs: list[Sequence], ks: list[int]) -> RoundPlan:
        sample_drafts = (  # a sampling drafter draws noise for the rows that sample
            any(ks)
            and self.drafter is not None
            and self.drafter.inner.samples
            and any(not s.params.greedy for s in seqs)
        )
        return make_plan(seqs, ks, self.vocab_size, self.device, self.rng, sample_drafts)

    def _process(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        drafts: torch.Tensor,
        num_draft: list[int],
    ) -> torch.Tensor:
        """Bias, penalties, the grammar mask, then vLLM's sampling rules (allowed tokens, bad
        words, min_tokens, min_p), at every verified position i as plain decoding would apply them
        after d_1..d_i (penalties.py, grammar.py, rules.py)."""
        logits = apply_penalties(logits, seqs, drafts)
        if any(s.matcher is not None for s in seqs):  # the drafts on the host (grammar rows)
            host = [row[:n] for row, n in zip(drafts.tolist(), num_draft)]
            logits = apply_grammar(logits, seqs, host)
        return apply_rules(logits, seqs, self.scheduler.eos_token_ids, drafts)

    @staticmethod
    def _probs(logits: torch.Tensor, plan: RoundPlan, top_n: int | None) -> torch.Tensor:
        """The processed target's probabilities; when every row is greedy and none asked for
        logprobs, the logits themselves (the rule takes only their argmax: rejection.py)."""
        if plan.noise is None and top_n is None:
            return logits
        return logits_to_probs(logits, plan.temperature, plan.top_k, plan.top_p, plan.filter_rows)

    @staticmethod
    def _top_n(seqs: list[Sequence]) -> int | None:
        """The most top alternatives a row asked for (0 = the chosen token's only), or None."""
        want = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        return max(want) if want else None
