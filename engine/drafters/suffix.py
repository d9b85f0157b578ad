"""Suffix decoding: no model, drafts by copying what followed the row's longest repeated suffix,
in its own prompt + output or in the output of other requests, the most frequent way.

Two indexes (engine/drafters/suffix_index.py) answer each row:

* its own: the request's prompt and every token it has committed, built when the row first
  drafts and extended each round after acceptance (``commit``), freed at ``remove``;
* the shared one: the outputs of recent requests (running ones included, as they are
  committed), kept after a request ends so that a later request that repeats an earlier answer
  (an edit, a retry, an agent's next step) drafts it; bounded by request count and tokens,
  least recently used first out.

Each index gives the continuation of the longest match of the row's last tokens (up to
``max_depth``), token by token the most frequent one while the product of their empirical
probabilities stays at least ``min_token_prob``, and at most ``max_spec_factor`` tokens per
matched token (a long match is trusted further) and the K asked. The draft with the larger
expected number of accepted tokens wins. A copy is deterministic: its q is one-hot, as
n-gram's, and the rejection rule keeps the output the target's whatever was copied.

Draft trees: where the round gives a row leaves (``plan.leaves``, the controller's call within
the verify's widest shape), the winning index's other continuations of the match go beside the
draft as its branches (suffix_index.py ``branch_out``: the best by their occurrences' share,
up to the leaves asked), and the engine verifies the draft and its branches as one tree
(engine/round/draft_tree.py). Every node was chosen from text, not drawn from a q: the tree
rule tries each as a point mass (engine/round/tree.py), exact for sampled rows whatever chose
the nodes, as nothing of the target's draws did.

A seeded sampled request drafts from its own index only: its draws follow its drafts, so a
draft that depended on other traffic would make its output depend on that traffic too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.drafters.base import Alternatives, DrafterBase, Proposal
from engine.drafters.ngram import grammar_prefix
from engine.drafters.suffix_index import NO_DRAFT, Draft, SuffixIndex
from engine.records.plan import RoundPlan
from engine.records.sequence import Sequence
from engine.transfer import to_device


@dataclass
class _Row:
    """One sequence's state: its own index (None until it first drafts) and its text in the
    shared index (its output since it was added)."""

    seq: Sequence
    own: SuffixIndex | None
    filed: int  # tokens of the sequence in ``own``
    shared: int  # its text's id in the shared index (-1: none)
    shared_filed: int  # output tokens filed in the shared index


class SuffixDrafter(DrafterBase):
    name = "suffix"
    samples = False
    trees = True  # the match's other continuations, where the round gives a row leaves

    def __init__(
        self,
        device: torch.device | str = "cpu",
        max_depth: int = 24,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_tokens: int = 100_000,
    ):
        if max_depth < 1:
            raise ValueError("suffix max_tree_depth is at least 1")
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ValueError("suffix cache sizes are at least 0 (0: no shared index)")
        if max_spec_factor <= 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("need suffix max_spec_factor > 0 and 0 <= min_token_prob <= 1")
        self.device = torch.device(device)
        self.max_depth, self.spec_factor, self.min_prob = max_depth, max_spec_factor, min_token_prob
        self.shared: SuffixIndex | None = None
        if max_cached_requests and max_cached_tokens:
            self.shared = SuffixIndex(max_cached_requests, max_cached_tokens)
        self.rows: dict[int, _Row] = {}  # id(seq) -> its state
        # rows drafted from each index, for tests, benchmarks and the hybrid's share
        self.own_drafts = 0
        self.shared_drafts = 0
        self.last_sources: list[str] = []  # the last proposal's: "own", "shared" or ""

    def steps(self, width: int) -> int:
        return 1 if width > 0 else 0  # one lookup, whatever the length

    def _row(self, seq: Sequence) -> _Row:
        row = self.rows.get(id(seq))
        if row is None or row.seq is not seq:
            n = len(seq.output_ids)
            tid = self.shared.open() if self.shared is not None else -1
            row = self.rows[id(seq)] = _Row(seq, None, 0, tid, n)
        return row

    def _sync_shared(self, row: _Row) -> None:
        out = row.seq.output_ids
        if self.shared is not None and row.shared_filed < len(out):
            if self.shared.text_of(row.shared) is None:  # pushed out while running: a new text
                row.shared = self.shared.open()
            self.shared.extend(row.shared, out[row.shared_filed :])
            row.shared_filed = len(out)

    def _sync_own(self, row: _Row) -> SuffixIndex:
        seq, own = row.seq, row.own
        if own is None:
            own = row.own = SuffixIndex()
            own.open()
        n = seq.num_tokens
        if row.filed < n:
            own.extend(0, seq.token_array()[row.filed : n].tolist())
            row.filed = n
        return own

    def add(self, seqs: list[Sequence], lazy: bool = False) -> None:
        for s in seqs:
            row = self._row(s)
            if not lazy:  # the prompt filed now, not in the first drafting round
                self._sync_own(row)

    def commit(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            row = self._row(s)
            self._sync_shared(row)
            if row.own is not None:
                self._sync_own(row)

    def remove(self, seq: Sequence) -> None:
        """Its own index is freed; its output stays in the shared index (until the bounds push
        it out)."""
        row = self.rows.pop(id(seq), None)
        if row is not None and row.seq is seq:
            self._sync_shared(row)

    @staticmethod
    def reads_shared(seq: Sequence) -> bool:
        """Whether row ``seq`` may draft from other requests' outputs: not a seeded sampled
        one, whose output must not depend on other traffic."""
        return seq.generator is None or seq.params.greedy

    def draft(self, seq: Sequence, k: int, branches: int = 0) -> tuple[Draft, str]:
        """Row ``seq``'s best draft of at most ``k`` tokens and the index it came from ("own",
        "shared"; "" with no draft); ``branches``: up to that many other continuations of its
        match beside it (``Draft.branches``)."""
        if k <= 0:
            return NO_DRAFT, ""
        row = self._row(seq)
        self._sync_shared(row)
        own = self._sync_own(row)
        context = own.texts[0]
        knobs = (self.max_depth, self.spec_factor, self.min_prob)
        best, source = own.draft(context, k, *knobs, branches=branches), "own"
        if self.shared is not None and self.reads_shared(seq):
            other = self.shared.draft(context, k, *knobs, exclude=row.shared, branches=branches)
            if other.score > best.score:
                best, source = other, "shared"
        return best, (source if best.tokens else "")

    def propose(self, seqs: list[Sequence], plan: RoundPlan) -> Proposal:
        leaves = getattr(plan, "leaves", None) or [0] * len(seqs)
        found = [self.draft(s, k, n) for s, k, n in zip(seqs, plan.ks, leaves)]
        self.last_sources = [src for _, src in found]
        self.own_drafts += self.last_sources.count("own")
        self.shared_drafts += self.last_sources.count("shared")
        drafts = grammar_prefix(seqs, [d.tokens for d, _ in found])
        width = max([len(d) for d in drafts] + [0])
        padded = [d + [0] * (width - len(d)) for d in drafts]
        tokens = to_device(padded, torch.long, self.device).reshape(len(seqs), width)
        num = [len(d) for d in drafts]
        # a row the grammar cut keeps its chain only (a tree row has no grammar: may_grow)
        branches = [d.branches if len(d.tokens) == n else [] for (d, _), n in zip(found, num)]
        alts = self.branches(branches, num, width) if any(branches) else None
        return Proposal(
            tokens=tokens, num=num, probs=None, alternatives=alts, copied=[n > 0 for n in num]
        )

    def branches(
        self, rows: list[list[tuple[int, float, int]]], num: list[int], width: int
    ) -> Alternatives:
        """The rows' branches (``Draft.branches`` of chains of ``num`` tokens) as the tree's
        candidates (drafters/base.py ``Alternatives``): no runners-up (S = 0), every branch a
        node of ``more`` in the id space where chain node j is j and branch i is ``width`` + i,
        worth its chance; each row's candidates tried as point masses (module docstring)."""
        batch, most = len(rows), max(len(r) for r in rows)
        tok = [[0] * most for _ in rows]
        worth = [[float("-inf")] * most for _ in rows]
        par = [[-1] * most for _ in rows]
        branch = 1  # the most children a node has (a chain node's chain child counted)
        for b, (row, n) in enumerate(zip(rows, num)):
            kids: dict[int, int] = {}
            for i, (t, p, parent) in enumerate(row):
                at = parent if parent < n else width + parent - n
                tok[b][i], worth[b][i], par[b][i] = t, p, at
                kids[at] = kids.get(at, 0) + 1
            branch = max([branch] + [c + (a < n) for a, c in kids.items()])  # (-1: the root)
        dev = self.device
        empty = torch.zeros(batch, width, 0, dtype=torch.long, device=dev)
        more = (
            to_device(tok, torch.long, dev).reshape(batch, most),
            to_device(worth, torch.float32, dev).reshape(batch, most),
            to_device(par, torch.long, dev).reshape(batch, most),
        )
        point = torch.ones(batch, dtype=torch.bool, device=dev)
        sizes = [len(r) for r in rows]
        return Alternatives(empty, empty.float(), more, branch, point, [True] * batch, sizes)
