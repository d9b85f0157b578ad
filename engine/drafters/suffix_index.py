"""A suffix index over token texts: where did the context's last tokens occur before, and what
followed them there, how often.

Each text (a request's prompt + output, or a finished request's output) is a token list. Every
position p of a text is filed under the n-grams that end just before it (``text[p - a : p]``
for each anchor length a in ``anchors``), so a lookup finds the earlier occurrences of the
context's last a tokens in one dict read. The real match length of each occurrence is then
counted backwards token by token (up to ``depth``), which also weeds out hash collisions, and
the occurrences with the longest match vote on the continuation token by token: the most
frequent next token, its empirical probability the share of the surviving occurrences that
continue with it. This is what a bounded-depth suffix tree gives (the subtree under the
context's longest matching suffix, counts per child), at one entry per position and anchor
instead of one node per position and depth.

Where the occurrences part ways, a draft may also carry *branches*: the other continuations of
that subtree, each a node with its token, its parent (a token of the draft or another branch)
and its estimated chance of being right, its occurrences' share of the match's. They are picked
best first (a child's share is never above its parent's, so the chosen ones hold their
ancestors), under the draft's ``min_prob`` and no deeper than the draft itself, for the engine
to verify as a draft tree beside it (engine/round/draft_tree.py).

Bounded memory: texts are kept in least-recently-used order, and past ``max_texts`` texts or
``max_tokens`` tokens the oldest are dropped. A dropped text's entries stay in the n-gram lists
(skipped at lookup) until they outnumber the live ones, when every list is rebuilt from the
live texts, so the index never holds more than about twice its live positions.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

ANCHORS = (8, 4, 2, 1)  # n-gram lengths positions are filed under, longest first
POS_BITS = 32  # an entry is text id << POS_BITS | position
POS_MASK = (1 << POS_BITS) - 1
COMPACT_FLOOR = 4096  # dead entries tolerated whatever the live count


@dataclass
class Draft:
    """A continuation: its tokens, each one's estimated chance that every token up to it is
    right (the product of the empirical probabilities), and the match it came from."""

    tokens: list[int]
    probs: list[float]
    match: int  # the length of the context's suffix that matched
    sources: int  # occurrences that voted for the first token
    # other continuations as (token, chance, parent), best first: parent -1 the root,
    # j < len(tokens) the draft's token j, len(tokens) + i branch i (parents come first)
    branches: list[tuple[int, float, int]] = field(default_factory=list)

    @property
    def score(self) -> float:
        """Expected tokens accepted, if the estimates are right."""
        return sum(self.probs)


NO_DRAFT = Draft([], [], 0, 0)


class SuffixIndex:
    """Texts filed by their n-grams (see the module's docstring). ``max_texts`` / ``max_tokens``:
    the LRU bounds (None: unbounded, a single request's own index); ``max_candidates``: the
    most recent occurrences a lookup weighs."""

    def __init__(
        self,
        max_texts: int | None = None,
        max_tokens: int | None = None,
        max_candidates: int = 32,
        anchors: tuple[int, ...] = ANCHORS,
    ):
        if max_texts is not None and max_texts < 1:
            raise ValueError("max_texts is at least 1 (None: unbounded)")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens is at least 1 (None: unbounded)")
        self.max_texts, self.max_tokens = max_texts, max_tokens
        self.max_candidates = max_candidates
        self.anchors = tuple(sorted(set(anchors), reverse=True))
        self.texts: OrderedDict[int, list[int]] = OrderedDict()  # LRU first
        self.grams: dict[int, array] = {}  # hash of an n-gram -> entries of the positions after
        self.tokens = 0  # live tokens
        self.entries = 0  # entries in ``grams`` (live and dropped texts')
        self.live_entries = 0
        self.evicted = 0  # texts dropped by the bounds, for tests and metrics
        self._next = 0

    def __len__(self) -> int:
        return len(self.texts)

    def open(self) -> int:
        """A new, empty text (the most recently used); returns its id."""
        tid = self._next
        self._next += 1
        self.texts[tid] = []
        self._bound(tid)
        return tid

    def extend(self, tid: int, tokens: list[int]) -> None:
        """Append ``tokens`` to text ``tid`` (dropped already: nothing) and file the new
        positions; the text becomes the most recently used. A text longer than ``max_tokens``
        alone keeps its first ``max_tokens``."""
        text = self.texts.get(tid)
        if text is None:
            return
        self.texts.move_to_end(tid)
        if self.max_tokens is not None:
            tokens = tokens[: max(self.max_tokens - len(text), 0)]
        if not tokens:
            return
        start = len(text)
        text.extend(tokens)
        self.tokens += len(tokens)
        base = tid << POS_BITS
        grams = self.grams
        added = 0
        for p in range(start + 1, len(text) + 1):
            for a in self.anchors:
                if a > p:
                    continue
                key = hash(tuple(text[p - a : p]))
                entries = grams.get(key)
                if entries is None:
                    grams[key] = array("q", (base | p,))
                else:
                    entries.append(base | p)
                added += 1
        self.entries += added
        self.live_entries += added
        self._bound(tid)

    def touch(self, tid: int) -> None:
        """Text ``tid`` was just useful: the last to be dropped."""
        if tid in self.texts:
            self.texts.move_to_end(tid)

    def drop(self, tid: int) -> None:
        """Forget text ``tid`` (its entries are skipped, then compacted away)."""
        text = self.texts.pop(tid, None)
        if text is None:
            return
        self.tokens -= len(text)
        self.live_entries -= self._filed(len(text))
        if self.entries - self.live_entries > max(self.live_entries, COMPACT_FLOOR):
            self._compact()

    def _filed(self, n: int) -> int:
        """Entries a text of ``n`` tokens has in ``grams``."""
        return sum(max(n - a + 1, 0) for a in self.anchors)

    def _bound(self, keep: int) -> None:
        """Drop the least recently used texts (never ``keep``) until within the bounds."""
        while len(self.texts) > 1 and (
            (self.max_texts is not None and len(self.texts) > self.max_texts)
            or (self.max_tokens is not None and self.tokens > self.max_tokens)
        ):
            oldest = next(iter(self.texts))
            if oldest == keep:  # ``keep`` is the least recently used: the next one goes
                oldest = next(t for t in self.texts if t != keep)
            self.drop(oldest)
            self.evicted += 1

    def _compact(self) -> None:
        """Rebuild every n-gram list from the live texts (their positions' order kept)."""
        texts = list(self.texts.items())
        self.texts = OrderedDict()
        self.grams, self.tokens, self.entries, self.live_entries = {}, 0, 0, 0
        for tid, text in texts:  # LRU order: the most recent entries stay last in each list
            self.texts[tid] = []
            self.extend(tid, text)

    def candidates(
        self, context: list[int], depth: int, exclude: int = -1
    ) -> tuple[int, list[tuple[list[int], int]]]:
        """The longest match: (its length L, its occurrences as (text, position after it)),
        L counted up to ``depth`` tokens; the most recent ``max_candidates`` occurrences of the
        longest anchor the context's end has any of are weighed. Positions with nothing after
        them (the context's own end, in a request's own index) and text ``exclude`` are
        skipped. (0, []) when the context's last token never occurred before."""
        n = len(context)
        for a in self.anchors:
            if a > n:
                continue
            entries = self.grams.get(hash(tuple(context[n - a :])))
            if entries is None:
                continue
            found: list[tuple[list[int], int, int]] = []
            scanned = 0
            for i in range(len(entries) - 1, -1, -1):
                scanned += 1
                if scanned > 4 * self.max_candidates or len(found) >= self.max_candidates:
                    break
                e = entries[i]
                tid, pos = e >> POS_BITS, e & POS_MASK
                if tid == exclude:
                    continue
                text = self.texts.get(tid)
                if text is None or pos >= len(text):
                    continue
                m = matched(text, pos, context, depth)
                if m >= a:  # shorter: a hash collision
                    found.append((text, pos, m))
            if found:
                best = max(m for _, _, m in found)
                return best, [(t, p) for t, p, m in found if m == best]
        return 0, []

    def draft(
        self,
        context: list[int],
        k: int,
        depth: int,
        spec_factor: float,
        min_prob: float,
        exclude: int = -1,
        branches: int = 0,
    ) -> Draft:
        """Up to ``k`` tokens that followed the context's longest match (:meth:`candidates`),
        at most ``spec_factor`` per matched token (at least one): each the most frequent next
        token of the occurrences still agreeing, while the running product of its empirical
        probabilities stays at least ``min_prob``. ``branches``: up to that many other
        continuations beside them (:func:`branch_out`)."""
        if k <= 0:
            return NO_DRAFT
        match, occ = self.candidates(context, depth, exclude)
        if not occ:
            return NO_DRAFT
        limit = min(k, max(1, int(spec_factor * match)))
        tokens: list[int] = []
        probs: list[float] = []
        sources = len(occ)
        every = occ
        cum = 1.0
        for j in range(limit):
            votes: dict[int, int] = {}
            for text, pos in occ:  # an occurrence that ended counts against every token
                if pos + j < len(text):
                    t = text[pos + j]
                    votes[t] = votes.get(t, 0) + 1
            if not votes:
                break
            tok = max(votes, key=votes.__getitem__)  # ties: the most recent occurrence's
            p = cum * votes[tok] / len(occ)
            if p < min_prob:
                break
            cum = p
            tokens.append(tok)
            probs.append(p)
            occ = [(t, q) for t, q in occ if q + j < len(t) and t[q + j] == tok]
        out = Draft(tokens, probs, match, sources)
        if branches > 0 and tokens:
            # no deeper than the draft: the round's walk stops at its widest draft
            out.branches = branch_out(every, tokens, len(tokens), min_prob, branches)
        return out

    def text_of(self, tid: int) -> list[int] | None:
        return self.texts.get(tid)


def votes_of(occ: list[tuple[list[int], int]], j: int) -> dict[int, list[tuple[list[int], int]]]:
    """The occurrences by their token ``j`` after the match (those that ended there vote for
    none), in the occurrences' order (the most recent first)."""
    out: dict[int, list[tuple[list[int], int]]] = {}
    for text, pos in occ:
        if pos + j < len(text):
            out.setdefault(text[pos + j], []).append((text, pos))
    return out


def branch_out(
    occ: list[tuple[list[int], int]],
    chain: list[int],
    limit: int,
    min_prob: float,
    most: int,
) -> list[tuple[int, float, int]]:
    """The ``most`` best continuations of the match's occurrences ``occ`` off its draft
    ``chain``, as ``Draft.branches``: the nodes of the trie of the occurrences' next ``limit``
    tokens that are not on the chain, each worth its occurrences' share of ``occ``, at least
    ``min_prob``, best first (ties: the earlier found, the more recent occurrence's first).
    Best first from the chain's nodes down: a node is a candidate once its parent is taken, and
    a child's share is never above its parent's, so these are the trie's ``most`` best off-chain
    nodes with every ancestor among them or on the chain."""
    n = len(occ)
    heap: list[tuple[float, int, int, int, list[tuple[list[int], int]]]] = []
    made = 0  # tie-break: the order found

    def offer(parent: int, j: int, agree: list[tuple[list[int], int]], skip: int | None) -> None:
        """The children of node ``parent`` (its ``agree`` occurrences), at offset ``j``."""
        nonlocal made
        if j >= limit:
            return
        for tok, group in votes_of(agree, j).items():
            share = len(group) / n
            if tok != skip and share >= min_prob:
                heapq.heappush(heap, (-share, made, tok, parent, group))
                made += 1

    agree = occ
    for j, tok in enumerate(chain):  # beside chain token j: children of its parent
        offer(j - 1, j, agree, tok)
        agree = [(t, q) for t, q in agree if q + j < len(t) and t[q + j] == tok]
    out: list[tuple[int, float, int]] = []
    depth: list[int] = []  # each branch's offset after the match
    while heap and len(out) < most:
        neg, _, tok, parent, group = heapq.heappop(heap)
        j = parent + 1 if parent < len(chain) else depth[parent - len(chain)] + 1
        out.append((tok, -neg, parent))
        depth.append(j)
        offer(len(chain) + len(out) - 1, j + 1, group, None)
    return out


def matched(text: list[int], pos: int, context: list[int], depth: int) -> int:
    """How many tokens before ``pos`` in ``text`` equal the context's last ones (up to
    ``depth``)."""
    m, n = 0, len(context)
    limit = min(depth, pos, n)
    while m < limit and text[pos - 1 - m] == context[n - 1 - m]:
        m += 1
    return m
