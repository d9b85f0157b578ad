"""The scheduler: which sequences wait, prefill and run, which KV slot each holds, and when one
finishes.

States: ``waiting`` (queued, no slot) -> ``prefilling`` (holds a slot, prompt not fully in the
cache) -> ``running`` (prompt in the cache, decoding in rounds) -> finished (slot freed).

Invariants:
  * A sequence holds a target KV slot exactly while it is prefilling or running.
  * Between rounds, the target cache of a running sequence holds every token but the last one,
    which is fed as the first verify token of the next round (:meth:`postprocess` commits it so).
  * Fairness: one group (the choices of one client request) holds at most
    ``max_slots_per_group`` slots and ``max_prefill_per_group`` prefill seats at once, so a
    request with many choices never takes the whole engine; a sequence past its group's cap
    waits while later arrivals of other groups are admitted.
  * Interactive first: a group of more than ``BULK`` sequences (a request with many choices or
    prompts) holds at most ``bulk_slots`` slots while a smaller group (a chat request) has a
    sequence in the engine, and for ``BULK_GRACE_S`` after; :meth:`make_room` preempts its rows
    past that, highest slots first, before the smaller group's are admitted (into the lowest
    free slots). On CPU a round costs with its rows, and a compiled forward with its highest
    slot (rows are slots: compiled.py), so beside a dozen rows of a big request a chat request's
    tokens came several times slower than alone (loadtest/results/fairness.txt). The preempted
    rows are recomputed from the prefix cache once the chat requests are gone.
  * Chunked prefill: at most ``prefill_chunk_tokens`` prompt tokens per step, so a long prompt
    never stalls the running streams for more than one chunk's forward.
  * Shared prefill: choices of one group with the same prompt prefill once. The first admitted
    is the lead; the others (``lead`` set) take no prefill seat and no chunk, and copy the lead's
    prompt KV into their slots when its prefill completes (:meth:`followers`).

  * Prefix caching (engine/kv/prefix_cache.py): an admitted sequence starts on the longest
    cached prefix of its prompt (copied into its slot, ``cached_tokens``) and prefills the rest;
    every commit offers the sequence's newly full blocks to the cache, its answer's included.
  * KV budget: the sequences holding slots hold at most ``kv_budget`` positions between them
    (a prefilling sequence its whole prefill, a running one its tokens plus ``lookahead``, what
    its next verify may write). Slots bound how many run at once; the budget bounds the memory
    they hold (on CPU the slot cache's pages are resident only where written and given back
    when a slot is freed: engine/kv/kv_cache.py). Admission waits for room in arrival
    order; when running sequences outgrow the budget, :meth:`make_room` preempts the latest
    admitted (it loses its KV and is queued first again, its prompt and output recomputed
    later, mostly from the prefix cache: ``Sequence.preempt``). A request never needs more
    than the budget: the engine's context is capped so.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv.paged_kv import KVCache
from engine.kv.paged_prefix import PagedPrefixCache
from engine.kv.prefix_cache import PrefixCache
from engine.records.sequence import Sequence, Status

BULK = 2  # a group of more sequences than this is a bulk request (it yields to smaller ones)
# seconds the bulk cap outlasts the last smaller request: chat clients send their next request
# a moment after the last one ended, and readmitting the bulk rows in that gap only to preempt
# them again recomputed them for nothing
BULK_GRACE_S = 1.0


def check_kv_budget(kv_budget: int | None, max_len: int) -> None:
    """A KV budget must hold one sequence of the context (:meth:`Scheduler.make_room` never
    preempts the last one, and admission would wait for ever): ValueError if not."""
    if kv_budget is not None and kv_budget < max_len:
        raise ValueError(
            f"kv_cache_tokens={kv_budget} cannot hold one sequence of the context's {max_len} "
            "tokens (max_model_len): raise it or lower max_model_len"
        )


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # prompt tokens already in the cache
    tokens: list[int]  # the prompt tokens this step feeds

    @property
    def completes(self) -> bool:
        return self.start + len(self.tokens) == len(self.seq.prefill_ids)


class Scheduler:
    def __init__(
        self,
        cache: KVCache,
        max_len: int,
        eos_token_ids: tuple[int, ...],
        *,
        max_prefill_per_step: int = 4,
        prefill_chunk_tokens: int = 512,
        max_slots_per_group: int | None = None,
        on_release: Callable[[Sequence], None] | None = None,
        prefix: PrefixCache | PagedPrefixCache | None = None,
        invariant: Callable[[Sequence], bool] = lambda s: False,
        kv_budget: int | None = None,
        lookahead: int = 1,
        bulk_slots: int | None = None,
    ):
        """``prefix``: the prefix cache (None: off); ``invariant``: whether a sequence's target
        forwards are the batch-invariant ones (its cached blocks are kept apart);
        ``kv_budget``: the positions the slot holders may hold in all (None: every slot its
        ``max_len``); ``lookahead``: positions past its tokens a running sequence's next
        verify may write (K_max); ``bulk_slots``: the slots a group of more than ``BULK``
        sequences holds while a smaller group has a sequence in the engine (None: no such cap)."""
        self.cache, self.max_len, self.eos_token_ids = cache, max_len, eos_token_ids
        self.max_prefill_per_step = max_prefill_per_step  # sequences prefilling at once
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)  # prompt tokens per step
        slots = cache.num_slots
        self.max_slots_per_group = max_slots_per_group or max(1, slots - slots // 4)
        self.max_prefill_per_group = max(1, max_prefill_per_step // 2)
        self.on_release = on_release  # called before a sequence's slot is freed (the drafter)
        self.prefix, self.invariant = prefix, invariant
        check_kv_budget(kv_budget, max_len)
        self.kv_budget = kv_budget if kv_budget is not None else slots * max_len
        self.lookahead = lookahead
        self.bulk_slots = bulk_slots
        self._smaller_seen = -BULK_GRACE_S  # when a smaller group was last in the engine
        self.preemptions = 0  # so far
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    # -- schedule -------------------------------------------------------------------------------
    def schedule_prefill(self) -> list[PrefillChunk]:
        """Admit waiting sequences into free slots, then pick this step's prompt chunks."""
        self._admit()
        budget, chunks = self.prefill_chunk_tokens, []
        for s in self.prefilling:
            if budget <= 0:
                break
            if s.lead is not None:  # it copies its lead's prefill (:meth:`followers`)
                continue
            start = self.cache.lengths[s.slot]
            chunk = s.prefill_ids[start : start + budget]
            chunks.append(PrefillChunk(s, start, chunk))
            budget -= len(chunk)
        return chunks

    def _caps(self) -> dict[str, int]:
        """The slots each group in the engine may hold now (see Interactive first)."""
        sizes: dict[str, int] = {}
        for s in (*self.waiting, *self.prefilling, *self.running):
            sizes[s.group] = sizes.get(s.group, 0) + 1
        cap, bulk = self.max_slots_per_group, self.bulk_slots
        if bulk is None:
            return dict.fromkeys(sizes, cap)
        now = time.perf_counter()
        if any(n <= BULK for n in sizes.values()):
            self._smaller_seen = now
        elif now - self._smaller_seen >= BULK_GRACE_S:
            return dict.fromkeys(sizes, cap)
        return {g: min(bulk, cap) if n > BULK else cap for g, n in sizes.items()}

    def _admit(self) -> None:
        caps, room = self._caps(), self.room()
        held: dict[str, int] = {}
        seats: dict[str, int] = {}
        for s in self.running:
            held[s.group] = held.get(s.group, 0) + 1
        for s in self.prefilling:
            held[s.group] = held.get(s.group, 0) + 1
            seats[s.group] = seats.get(s.group, 0) + 1
        for s in list(self.waiting):
            if not self.cache.num_free():
                return
            # a choice whose prompt a choice of its group is prefilling shares that prefill: it
            # takes a slot but no prefill seat or compute
            s.lead = next(
                (
                    p
                    for p in self.prefilling
                    if p.group == s.group and p.lead is None and p.prefill_ids == s.prefill_ids
                ),
                None,
            )
            prefilling = sum(p.lead is None for p in self.prefilling)  # followers feed nothing
            if s.lead is None and prefilling >= self.max_prefill_per_step:
                return
            if held.get(s.group, 0) >= caps[s.group] or (
                s.lead is None and seats.get(s.group, 0) >= self.max_prefill_per_group
            ):
                s.lead = None
                continue  # its group is at its cap: later arrivals of other groups go first
            if room < self._holds(len(s.prefill_ids)):  # its prefill and its first verify
                s.lead = None
                return  # in arrival order: a long prompt is not overtaken for ever
            room -= len(s.prefill_ids)  # what it holds while prefilling (:meth:`held`)
            self.waiting.remove(s)
            s.slot = self.cache.allocate()
            # its cached prefix, unless a lead's prefill serves it or every prompt position's
            # logits are asked for (prompt logprobs, not yet sent)
            if self.prefix is not None and s.lead is None and not s.scores_prompt:
                s.cached_tokens = self.prefix.restore(s.slot, s.prefill_ids, self.invariant(s))
            s.status, s.admitted = Status.RUNNING, time.perf_counter()
            self.prefilling.append(s)
            held[s.group] = held.get(s.group, 0) + 1
            seats[s.group] = seats.get(s.group, 0) + (s.lead is None)

    def prefilled(self, chunk: PrefillChunk) -> None:
        """The chunk's tokens are in the cache; a sequence whose prompt is complete leaves
        ``prefilling`` (it joins ``running`` once its first token is sampled)."""
        end = chunk.start + len(chunk.tokens)
        self.cache.commit(chunk.seq.slot, end)
        if self.prefix is not None:
            s = chunk.seq
            self.prefix.store(s.slot, s.prefill_ids[:end], self.invariant(s))
        if chunk.completes:
            self.prefilling.remove(chunk.seq)

    def followers(self, lead: Sequence) -> list[Sequence]:
        """The choices waiting to copy ``lead``'s prefill (now complete): they leave
        ``prefilling`` with ``lead``'s prompt committed to their own slots."""
        out = [s for s in self.prefilling if s.lead is lead]
        for s in out:
            self.cache.copy(lead.slot, s.slot, len(s.prefill_ids))
            if self.prefix is not None:
                self.prefix.copy_known(lead.slot, s.slot, len(s.prefill_ids))
            s.cached_tokens, s.lead = lead.cached_tokens, None
            self.prefilling.remove(s)
        return out

    def start_running(self, seqs: list[Sequence]) -> None:
        self.running += [s for s in seqs if s.status is Status.RUNNING]

    # -- postprocess ----------------------------------------------------------------------------
    def postprocess(self, s: Sequence, tokens: list[int]) -> list[int]:
        """Append ``tokens`` up to the first stop condition (stop id / EOS, max_tokens, the
        context) and commit the target cache, or finish the sequence. Returns what was kept."""
        stops = set(s.params.stop_token_ids)
        if not s.params.ignore_eos:
            stops.update(self.eos_token_ids)
        limit = min(s.remaining, self.max_len - s.num_tokens)
        out: list[int] = []
        reason = None
        for t in tokens:
            out.append(t)
            if t in stops:
                reason = "stop"
                break
            if len(out) >= limit:
                reason = "length"
                break
        s.append(out)
        if reason is None and s.num_tokens >= self.max_len:
            reason = "length"
        if self.prefix is not None:  # its answer too, finished or not: the next turn resends it
            self.prefix.store(s.slot, s.token_array()[: s.num_tokens - 1], self.invariant(s))
        if reason is not None:
            self.finish(s, reason)
        else:
            self.cache.commit(s.slot, s.num_tokens - 1)
        return out

    def retire(self) -> None:
        """Drop finished sequences from ``running`` (after a round's postprocess)."""
        self.running = [s for s in self.running if s.status is Status.RUNNING]

    def finish(self, s: Sequence, reason: str) -> None:
        s.status, s.finish_reason = Status.FINISHED, reason
        self._release(s)

    # -- the KV budget ------------------------------------------------------------------------
    def _holds(self, tokens: int) -> int:
        """Positions a running sequence of ``tokens`` tokens counts against the budget: its
        tokens and what its next verify may write, never past the context."""
        return min(tokens + self.lookahead, self.max_len)

    def held(self) -> int:
        """Positions the slot holders count against the budget: a prefilling sequence its
        whole prefill, a running one :meth:`_holds`."""
        growing = sum(self._holds(s.num_tokens) for s in self.running)
        return growing + sum(len(s.prefill_ids) for s in self.prefilling)

    def room(self) -> int:
        """Positions of the budget no slot holder counts."""
        return self.kv_budget - self.held()

    def make_room(self) -> list[Sequence]:
        """Before admission and the round: preempt a bulk group's rows past its cap while a
        smaller group is in the engine (highest slots first: the smaller group's rows take the
        lowest free ones), then, while the slot holders outgrow the budget, the latest admitted
        (never the last one: a sequence alone always fits). Returns the preempted."""
        out: list[Sequence] = []
        caps = self._caps()
        holders = sorted((*self.running, *self.prefilling), key=lambda s: s.slot)
        held: dict[str, int] = {}
        for s in holders:  # lowest slots first: a group keeps its lowest
            held[s.group] = held.get(s.group, 0) + 1
            if held[s.group] > caps[s.group]:
                self.preempt(s)
                out.append(s)
        while self.room() < 0 and len(self.running) + len(self.prefilling) > 1:
            victim = max((*self.running, *self.prefilling), key=lambda s: s.admitted or 0.0)
            self.preempt(victim)
            out.append(victim)
        return out

    def preempt(self, s: Sequence) -> None:
        """``s`` gives its slot back and is queued first, to be recomputed (its committed blocks
        are in the prefix cache already, when it is on)."""
        self.running = [r for r in self.running if r is not s]
        self.prefilling = [p for p in self.prefilling if p is not s]
        self._release(s)
        s.preempt()
        self.waiting.appendleft(s)
        self.preemptions += 1

    def _release(self, s: Sequence) -> None:
        """Free ``s``'s slot (and its drafter state); a lead's followers get a new lead."""
        heir = None  # a lead that ends early: its first follower leads the others
        for f in self.prefilling:
            if f.lead is s:
                f.lead, heir = heir, heir or f
        if s.slot >= 0:
            if self.on_release is not None:
                self.on_release(s)
            if self.prefix is not None:
                self.prefix.forget(s.slot)
            self.cache.free(s.slot)
            s.slot = -1

    def abort(self, request_id: str) -> bool:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                return True
        for group in (self.prefilling, self.running):
            for seq in group:
                if seq.request_id == request_id:
                    self.finish(seq, "abort")
                    group.remove(seq)
                    return True
        return False
