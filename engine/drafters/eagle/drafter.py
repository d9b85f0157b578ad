"""The EAGLE-3 drafter: a one-layer head over the target's own features
(engine/drafters/eagle/head.py).

State per slot:
  * the head's KV cache (one layer): positions ``[0, real)`` hold K/V computed from the target's
    features ("real" positions); drafting writes further positions, dropped at commit;
  * ``skipped``: sequence positions whose features the head never ingested (below); ``pending``:
    the target features of sequence positions ``[skipped + real, ...)`` not ingested yet.

Bookkeeping (N = the sequence's token count; the target has computed features for positions
``[0, N - 1)`` plus the verified ones):
  * ``observe`` (after every target forward: prefill chunks, verifies) appends the features of
    the positions that forward computed, ``[start, start + count)``, to ``pending``.
  * ``add`` (prompt prefilled) ingests positions ``[c, P - 1)`` of a prompt of P tokens whose
    first c came from the prefix cache (``Sequence.cached_tokens``: the target computed no
    features for them, so the head starts after them, as if they were skipped; ``lazy``, no
    draft expected soon: leaves them pending, for commit to skip).
  * ``propose`` first ingests every pending position p, paired with t_{p+1} (one ragged
    forward; its last output gives d_1), then drafts d_2..d_K by feeding its own output and
    the previous draft at the next position. d_K is never fed.
  * ``commit`` rolls the cache back to ``real`` and keeps only the pending features of
    positions < N - 1 (the accepted ones: a verify's rejected positions are dropped). A row
    that gathers more than 2 ``WINDOW`` pending positions (rounds at K = 0) drops all but the last
    ``WINDOW``, the ``skipped``; drafting again, the head ingests the rest after its real positions
    (as if the skipped stretch were not there: drafts are proposals, output stays exact). K = 0
    costs the head nothing (ingesting every position instead was a visible share of plain
    decoding on CPU: docs/measurements.md).
Invariant after ``commit``: ``skipped + real + len(pending) == N - 1``, so the next verify
(which starts at position N - 1) continues ``pending`` without a gap; ``observe`` checks it.
"""

from __future__ import annotations

import torch

from engine.drafters.base import Alternatives, DrafterBase, Proposal
from engine.drafters.chain import Position, RowParams, draft_chain
from engine.drafters.eagle.expand import Expansion
from engine.drafters.eagle.head import Eagle3Head
from engine.model.compiled import default_buckets
from engine.model.runner import ModelRunner
from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence
from engine.sampling.grammar import DraftGrammar
from engine.sampling.probs import logits_to_probs, race
from engine.transfer import to_device

WINDOW = 16  # pending positions a row keeps at K = 0 (up to twice as many); older ones skipped


def cache_len(max_len: int, branch: int, k_max: int) -> int:
    """The positions a slot of the head's cache holds: the sequence's ``max_len`` and the
    columns a draft tree's extras write past the chain's (expand.py: ``k_max`` steps of
    ``branch`` columns; none without trees)."""
    return max_len + (k_max * branch if branch >= 2 else 0)


def step_buckets() -> list[int]:
    """The query lengths the head's fast path pads a call to: an ingest's 1 to 2 ``WINDOW``
    pending positions (a longer one, a prompt's at admission, runs eagerly), a chained step's
    1."""
    return default_buckets(2 * WINDOW)


class RunnersUp:
    """Each drafted token's runners-up while the chain is drafted (a draft tree's candidate
    siblings, engine/round/draft_tree.py): ranking a position's weights ``keys`` (q itself for
    a greedy row; q / E for a sampled one, the exponential race whose first arrival is the draft)
    puts the draft first and the runners-up after it in the order drawn, so a sampled row's
    runners-up are a sample of q without replacement, as the tree's rule needs.

    Worth of a runner-up at position j (its chance of being accepted, as :func:`grow` ranks
    nodes): the head's probability of the chain before it times, for a greedy row, its own q; for
    a sampled row a guess that reads no runner-up's own draw, (1 - q(draft)) / 2^r for the r-th
    (which runners-up a tree keeps must not depend on their draws: a kept one would no longer be
    distributed as q given the draws before it). Zero-q candidates (past q's support) are none."""

    def __init__(self, batch: int, kmax: int, width: int, device: torch.device):
        self.width = width
        self.tokens = torch.zeros(batch, kmax, width, dtype=torch.long, device=device)
        self.values = torch.full((batch, kmax, width), float("-inf"), device=device)
        self.path = torch.ones(batch, device=device)  # [batch] q of the chain drafted so far
        self.decay = 0.5 ** torch.arange(1, width + 1, device=device)  # [S]

    def take(self, keys, q, row_t, j, greedy, ids=None) -> torch.Tensor:
        """Rank ``keys`` ``[rows, V]`` (q ``[rows, V]``, ``ids``: V's target ids, None: the
        identity); record position j's runners-up; returns the drafted tokens ``[rows]``."""
        top = keys.topk(self.width + 1, dim=-1).indices  # [rows, S + 1] in the order drawn
        pick, after = top[:, 0], top[:, 1:]
        q_pick, q_after = q.gather(-1, pick[:, None])[:, 0].float(), q.gather(-1, after).float()
        path = self.path[row_t]  # [rows]
        guess = (1.0 - q_pick)[:, None] * self.decay  # [rows, S]
        worth = path[:, None] * torch.where(greedy[:, None], q_after, guess)
        self.values[row_t, j] = worth.masked_fill(q_after <= 0, float("-inf"))
        self.tokens[row_t, j] = after if ids is None else ids[after]
        self.path[row_t] = path * q_pick
        return pick if ids is None else ids[pick]


class EagleDrafter(DrafterBase):
    name, samples = "eagle3", True
    trees = True  # the head's runners-up

    def __init__(self, head: Eagle3Head, runner: ModelRunner, vocab: int, branch: int = 0):
        """``runner``: the head's stack (stack.py) over a cache of its own, of
        :func:`cache_len` positions a slot, built by the builder with its 4-bit matrices
        (``drafter.head_q4``) and its fast path (compiled or captured, as the target's) chosen
        there, never changed afterwards. ``vocab``: the target's. ``branch`` B >= 2: draft
        trees expand EAGLE-2's way (expand.py), B children a node and B - 1 extras a depth;
        else a tree is the chain's runners-up."""
        self.branch = branch if branch >= 2 else 0
        self.head, self.head_runner, self.vocab_size = head.eval(), runner, vocab
        self.cache = runner.cache
        self.device, self.dtype = runner.device, runner.dtype
        self.taps = tuple(head.config.aux_layers)
        self.kv_idx = torch.arange(self.cache.max_len + 1, device=self.device)  # key positions
        self.draft_ids = head.draft_to_target  # [draft_vocab] target id of each draft id
        self.pending: dict[int, list[torch.Tensor]] = {}  # slot -> [n, taps * hidden] pieces
        self.pending_n: dict[int, int] = {}
        self.real: dict[int, int] = {}  # slot -> cache positions computed from real features
        self.skipped: dict[int, int] = {}  # slot -> sequence positions never ingested

    @property
    def q4(self) -> bool:
        """Whether the head's matrices run 4-bit (``drafter.head_q4`` where the kernel applies)."""
        return "+q4-" in self.head_runner.path()

    # -- life cycle ---------------------------------------------------------------------------
    def observe(
        self, seqs: list[Sequence], hidden: torch.Tensor, starts: list[int], counts: list[int]
    ) -> None:
        """``hidden`` ``[batch, q, taps * hidden]``: the target's features of positions
        ``[starts[b], starts[b] + counts[b])`` of row b."""
        for b, (s, start, n) in enumerate(zip(seqs, starts, counts)):
            if not s.spec.enabled:
                continue
            if start == s.cached_tokens:  # a new prompt: its cached prefix is skipped
                self.pending[s.slot], self.pending_n[s.slot] = [], 0
                self.real[s.slot], self.skipped[s.slot] = 0, start
            elif self.skipped[s.slot] + self.real[s.slot] + self.pending_n[s.slot] != start:
                raise ValueError("EAGLE features out of step with the sequence")
            self.pending[s.slot].append(hidden[b, :n])
            self.pending_n[s.slot] += n

    def add(self, seqs: list[Sequence], lazy: bool = False) -> None:
        rows = [s for s in seqs if s.spec.enabled]
        for s in rows:
            self.cache.allocate(s.slot)
            if self.pending_n.get(s.slot) != len(s.prefill_ids) - s.cached_tokens:
                raise ValueError("EAGLE head: the prompt's features are missing")
        rows = [s for s in rows if not lazy or s.spec.k]  # lazy: pending, unless K is fixed
        take = [len(s.prefill_ids) - 1 - s.cached_tokens for s in rows]
        if any(take):
            self._ingest([s for s, n in zip(rows, take) if n], [n for n in take if n])

    def fork(self, src: Sequence, dst: Sequence) -> None:
        if dst.spec.enabled and src.slot in self.pending:  # the prompt's features, shared
            self.pending[dst.slot] = list(self.pending[src.slot])
            for d in (self.pending_n, self.real, self.skipped):
                d[dst.slot] = d[src.slot]

    def remove(self, seq: Sequence) -> None:
        self.cache.free(seq.slot)
        for d in (self.pending, self.pending_n, self.real, self.skipped):
            d.pop(seq.slot, None)

    def own_path(self) -> str:
        """How the head's step runs now: its runner's path (ModelRunner.path)."""
        return self.head_runner.path()

    def backlogs(self, seqs: list[Sequence]) -> list[int]:  # < 2·WINDOW: commit drops older
        return [max(self.pending_n.get(s.slot, 0) - 1, 0) for s in seqs]

    def commit(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            slot, real = s.slot, self.real[s.slot]
            self.cache.rollback(slot, real)  # drop the drafted chain's K/V
            keep = s.num_tokens - 1 - self.skipped[slot] - real
            drop = keep - WINDOW if keep > 2 * WINDOW else 0  # the oldest at K = 0: skipped
            if keep < self.pending_n[slot] or drop:
                self.pending[slot] = [torch.cat(self.pending[slot])[drop:keep]]
                self.pending_n[slot], self.skipped[slot] = keep - drop, self.skipped[slot] + drop

    def warm_up(self) -> None:
        """Compile or capture the head's fast path (nothing committed is read or changed)."""
        self.head_runner.warm_up()

    # -- drafting -----------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        """Take in every pending position (the last one's output drafts d_1), then chain the
        head on its own output and the previous draft (:func:`draft_chain`); with
        ``plan.alternatives``, each drafted token's runners-up too (:class:`RunnersUp`), and
        with ``branch`` the tree rows' expansion (expand.py) in the chain's calls."""
        # q matters only to sampled rows: an all-greedy batch reports none (one-hot)
        sampled = any(not plan.params[b].greedy for b, k in enumerate(plan.ks) if k > 0)
        runners, grown = None, None
        # tree rows drafted by expansion: deterministic, their candidates point masses
        leaves = plan.leaves or [0] * len(seqs)
        expand = [bool(self.branch and n and k) for n, k in zip(leaves, plan.ks)]
        if plan.alternatives and any(plan.ks):
            width = self.branch - 1 if any(expand) else plan.alternatives
            runners = RunnersUp(len(seqs), max(plan.ks), width, self.device)
        if any(expand):
            hidden = self.head.config.hidden_size
            grown = Expansion(
                len(seqs), max(plan.ks), width, self.branch, hidden, self.dtype, self.device
            )
        point = to_device(expand, torch.bool, self.device) if grown is not None else None

        def step(at: Position, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            rows = [seqs[b] for b in at.rows]
            if at.prev is None or out is None:  # ingest: the pending positions
                out, logits = self._ingest(rows, [self.pending_n[s.slot] for s in rows])
                return logits, out
            if at.keep is not None:
                out = out[at.keep]
            slots = [s.slot for s in rows]
            starts = [self.cache.lengths[s] for s in slots]
            trees = [i for i, b in enumerate(at.rows) if expand[b]]
            if grown is not None and runners is not None and trees:
                out, logits = self._grow_step(at, out, trees, slots, grown, runners, plan)
            else:
                out, logits = self.chain_step(at.prev, out, slots)  # (output, draft)
            for s, st in zip(slots, starts):
                self.cache.commit(s, st + 1)
            return logits, out

        def choose(logits, rows, row_t, j, p: RowParams, guide: DraftGrammar):
            if point is not None:  # a tree row drafts its top q
                p = p._replace(greedy=p.greedy | point[row_t])
            return self._choose(
                logits, rows, row_t, j, p, plan, guide, sampled=sampled, runners=runners
            )

        prop = draft_chain(seqs, plan, self.vocab_size, sampled, step, choose)
        if runners is not None:
            more = (grown.tokens, grown.values, grown.parents) if grown is not None else None
            point_rows = expand if grown is not None else None
            alts = Alternatives(
                runners.tokens, runners.values, more, self.branch, point, point_rows
            )
            prop.alternatives = alts
        if grown is not None:  # the extras fed at every step but a row's first
            prop.extra_rows = grown.e * sum(k - 1 for k, x in zip(plan.ks, expand) if x)
        if prop.probs is not None and point is not None:  # a deterministic draft's q is one-hot
            rows_t = point.nonzero()[:, 0]
            hot = torch.nn.functional.one_hot(prop.tokens[rows_t], self.vocab_size)
            prop.probs[rows_t] = hot.to(prop.probs.dtype)
        return prop

    @torch.inference_mode()
    def _grow_step(self, at: Position, out, trees, slots, grown: Expansion, runners, plan):
        """Step j of a round with tree rows: the chain rows' step and the tree rows' extras of
        depth j in one head call (expand.py); returns the chain rows' outputs and logits."""
        j, rows = at.j, at.rows
        assert at.prev is not None
        pos_i = to_device(trees, torch.long, self.device)  # the tree rows among ``rows``
        rows_t = to_device([rows[i] for i in trees], torch.long, self.device)  # batch indices
        e, w = grown.e, grown.w
        tok, x, bits = grown.select(
            j, rows_t, out[pos_i], runners.tokens[rows_t, j - 1], runners.values[rows_t, j - 1]
        )
        real = [self.real[s] for s in slots]
        tree_real = [real[i] for i in trees for _ in range(e)]
        col = grown.columns(j).repeat(len(trees))  # [R E]
        all_real = to_device(real + tree_real, torch.long, self.device)  # [V]
        write = torch.cat([all_real[: len(rows)] + j - 1, all_real[len(rows) :] + col])
        pos = all_real + j - 1  # [V]: a node of depth j sits at real + j - 1
        vis = torch.cat([grown.chain_bits(j, len(rows)), bits])  # [V, W]
        ids = torch.cat([at.prev, tok])[:, None]  # [V, 1]
        xs = torch.cat([out, x.to(out.dtype)])[:, None]  # [V, 1, hidden]
        all_slots = slots + [slots[i] for i in trees for _ in range(e)]
        # the keys each node sees: its row's committed prefix, and the tree columns past it that
        # ``vis`` marks (its ancestors and itself)
        rel = self.kv_idx[None, : max(real) + w] - all_real[:, None]  # [V, kv_len]: tree column
        seen = vis.gather(1, rel.clamp(0, w - 1)) & (rel >= 0) & (rel < w)
        mask = ((rel < 0) | seen)[:, None, None, :]  # [V, 1, 1, kv_len]
        f = self.head_runner.forward_at(ids, all_slots, pos[:, None], write[:, None], mask, x=xs)
        assert f.output is not None
        o, logits = f.output[:, 0], f.logits[:, 0]  # [V, hidden], [V, draft_vocab]
        n = len(rows)
        temp = plan.temperature[rows_t].repeat_interleave(e)[:, None]
        grown.children(j, rows_t, o[n:], torch.softmax(logits[n:] / temp, -1), self.draft_ids)
        return o[:n], logits[:n]

    def _choose(self, draft_logits, rows, row_t, j, row_p, plan, guide, *, sampled, runners=None):
        """Draft position j of ``rows`` from the head's logits over the draft vocabulary
        ``[rows, draft_vocab]``: the target ids drafted ``[rows]`` and q over the target
        vocabulary ``[rows, vocab]`` (zero outside the draft vocabulary; None unless
        ``sampled``). Grammar rows and top-k / top-p run over the whole vocabulary; otherwise q
        is the softmax over the draft vocabulary (the same q). A sampled row draws by the
        exponential race (its first arrival); ``runners`` takes the arrivals after it."""
        temp, top_k, top_p, greedy = row_p
        noise, ids = plan.draft_noise, self.draft_ids
        if guide or plan.filter_rows:
            full = draft_logits.new_full((len(rows), self.vocab_size), float("-inf"))
            full[:, ids] = draft_logits
            logits = guide.mask(full, rows)  # grammar rows: what it allows next
            q = logits_to_probs(logits[:, None], temp, top_k, top_p, plan.filter_rows)[:, 0]
            if runners is not None:
                keys = q if noise is None else torch.where(greedy[:, None], q, q / noise[row_t, j])
                return runners.take(keys, q, row_t, j, greedy), q
            if noise is None:
                return q.argmax(-1), q
            return torch.where(greedy, q.argmax(-1), race(q, noise[row_t, j])), q
        if not sampled:
            if runners is not None:
                qd = torch.softmax(draft_logits.float(), dim=-1)
                return runners.take(qd, qd, row_t, j, greedy, ids), None
            return ids[draft_logits.argmax(-1)], None
        qd = torch.softmax(draft_logits / temp[:, None], dim=-1)  # [rows, draft_vocab]
        if runners is not None:
            keys = qd
            if noise is not None:
                keys = torch.where(greedy[:, None], qd, qd / noise[row_t, j][:, ids])
            pick = runners.take(keys, qd, row_t, j, greedy, ids)
        else:
            pick = ids[qd.argmax(-1)]
            if noise is not None:  # the exponential race over the draft vocabulary
                pick = torch.where(greedy, pick, ids[race(qd, noise[row_t, j][:, ids])])
        q = qd.new_zeros(len(rows), self.vocab_size)
        q[:, ids] = qd
        return pick, q

    # -- the head -----------------------------------------------------------------------------
    @torch.inference_mode()
    def _ingest(self, seqs: list[Sequence], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Take in the first ``counts[b]`` pending positions p of row b, each paired with token
        t_{p+1}; returns the head's output ``[rows, hidden]`` and draft logits
        ``[rows, draft_vocab]`` at each row's last one."""
        slots = [s.slot for s in seqs]
        starts = [self.cache.lengths[s] for s in slots]
        q = max(counts)
        feats = torch.zeros(
            len(seqs), q, self.head.fc.in_features, dtype=self.dtype, device=self.device
        )  # [rows, q, taps * target_hidden]
        ids = []
        for b, (s, st, n) in enumerate(zip(seqs, starts, counts)):
            pend = torch.cat(self.pending[s.slot])
            feats[b, :n] = pend[:n]
            self.pending[s.slot], self.pending_n[s.slot] = [pend[n:]], len(pend) - n
            t = self.skipped[s.slot] + st + 1  # the token after each position ingested
            nxt = s.token_array()[t : t + n].tolist()
            ids.append(nxt + [0] * (q - n))
        ids_t = to_device(ids, torch.long, self.device)  # [rows, q]
        f = self.head_runner.forward(ids_t, slots, counts, x=feats)  # at the cache's lengths
        for slot, st, n in zip(slots, starts, counts):
            self.cache.commit(slot, st + n)
            self.real[slot] = st + n
        assert f.output is not None
        return f.output, f.logits

    @torch.inference_mode()
    def chain_step(
        self, tok: torch.Tensor, out: torch.Tensor, slots: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained draft step: tokens ``tok`` ``[rows]`` with the head's previous outputs
        ``out`` ``[rows, hidden]`` at each slot's cache length; K/V written there (the caller
        commits them, or rolls them back). Returns the new outputs ``[rows, hidden]`` and draft
        logits ``[rows, draft_vocab]``."""
        f = self.head_runner.forward(tok[:, None], slots, [1] * len(slots), x=out[:, None])
        assert f.output is not None
        return f.output, f.logits
