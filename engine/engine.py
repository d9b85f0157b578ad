"""The speculative engine: ``step()`` = schedule -> prefill chunks / round -> outputs.

  1. schedule  -- the scheduler admits waiting sequences into free KV slots (fairly across
                  requests) and picks this step's prompt chunks (scheduler.py).
  2. prefill   -- target forwards of the chunks, several to one (prefill.py); a sequence
                  whose prompt is complete samples its first token from its last chunk's
                  logits and joins the running batch (or, with
                  max_tokens = 0, finishes: its prompt scored, prompt_logprobs.py). Choices of
                  one request with the same prompt share one prefill (scheduler.py).
  3. round     -- one speculative round over every running sequence (round/speculator.py).
  4. outputs   -- each request's new tokens (with logprobs / stats) as :class:`StepOutput`.

The engine is single-threaded: only the thread that drives ``step()`` touches it (worker.py).
Terms (K, accepted, recovered, bonus) are defined in rejection.py.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import torch

from engine.drafters.base import Drafter
from engine.drafters.guard import GuardedDrafter
from engine.kcontrol.controller import AdaptiveK, FixedK, KController
from engine.kv.kv_cache import SlotKVCache
from engine.kv.paged_kv import PagedKVCache
from engine.kv.paged_prefix import PagedPrefixCache
from engine.kv.prefix_cache import PrefixCache
from engine.model.runner import ModelRunner
from engine.protocol import EngineLoad
from engine.records.output import StepOutput
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import Sequence
from engine.requests.prefill import run_chunks
from engine.requests.scheduler import PrefillChunk, Scheduler
from engine.round.rejection import rejection_sample
from engine.round.speculator import AcceptRule, Speculator
from engine.sampling.grammar import GrammarCompiler

__all__ = ["EngineLoad", "SpecEngine"]


class SpecEngine:
    def __init__(
        self,
        target: ModelRunner,
        drafter: Drafter | None,
        eos_token_ids: list[int],
        *,
        max_prefill_per_step: int = 4,
        prefill_chunk_tokens: int = 512,
        controller: KController | None = None,
        k_max: int = 8,
        max_slots_per_request: int | None = None,
        grammars: GrammarCompiler | None = None,
        deterministic: str = "off",
        accept: AcceptRule = rejection_sample,
        prefix_cache_tokens: int = 0,
        prefix_block_size: int = 16,
        kv_cache_tokens: int | None = None,
        bulk_slots: int | None = None,
        seed: int | None = None,
    ):
        """``accept``: the round's acceptance rule, the exact rejection rule unless a benchmark
        builds the engine with a synthetic one (then not lossless: the worker refuses it).
        ``prefix_cache_tokens``: the prefix cache's size (engine/kv/prefix_cache.py; 0: off),
        in blocks of ``prefix_block_size`` positions; over a paged cache, nonzero turns on
        caching in its own blocks (engine/kv/paged_prefix.py: the builder sized its pool).
        ``kv_cache_tokens``: the KV positions the running sequences may hold in all (None:
        every slot its ``max_len``); at least one sequence's ``max_len``. ``bulk_slots``: the
        slots a request of many sequences holds while a smaller one is in the engine
        (scheduler.py; None: no such cap). ``seed``: the engine's generator's (None: from the
        OS)."""
        self.target, self.drafter = target, drafter
        self.k_max = k_max if drafter is not None else 0
        if controller is None:
            controller = AdaptiveK(k_max, drafter.steps) if drafter is not None else FixedK(0)
        self.controller = controller
        controller.price_shapes(target.padded_shape)  # the fast path pads verify shapes
        self.guard = GuardedDrafter(drafter) if drafter is not None else None
        if drafter is not None and drafter.taps != target.taps:  # what the drafter reads
            raise ValueError(
                f"the drafter reads the target's layers {drafter.taps}, the target runner taps "
                f"{target.taps}: build the runner with taps=drafter.taps"
            )
        prefix: PrefixCache | PagedPrefixCache | None = None
        if isinstance(target.cache, PagedKVCache) and prefix_cache_tokens:  # in its own blocks
            prefix = PagedPrefixCache(target.cache, prefix_cache_tokens)
        elif isinstance(target.cache, SlotKVCache) and (
            blocks := prefix_cache_tokens // prefix_block_size
        ):
            # a pool of copies beside the slots
            prefix = PrefixCache(target.cache, blocks, prefix_block_size)
        self.scheduler = Scheduler(
            target.cache,
            target.max_len,
            tuple(eos_token_ids),
            max_prefill_per_step=max_prefill_per_step,
            prefill_chunk_tokens=prefill_chunk_tokens,
            max_slots_per_group=max_slots_per_request,
            on_release=self.guard.remove if self.guard is not None else None,
            prefix=prefix,
            invariant=lambda s: self._invariant([s]),
            kv_budget=kv_cache_tokens,
            lookahead=self.k_max + 1,  # a verify writes K + 1 positions
            bulk_slots=bulk_slots,
        )
        self.device = target.device
        self.vocab_size = target.vocab_size
        self.grammars = grammars  # matchers for requests with a grammar (structured outputs)
        self.deterministic = (
            deterministic  # "off" | "request" | "always" (engine/model/invariant.py)
        )
        # several prompt chunks to one forward (prefill.py): on CUDA only, where an eager forward
        # costs about the same for 1 or 4 short prompts; on CPU, where a forward is
        # compute-bound, the padding made it slower (docs/measurements.md)
        self.group_prefill = self.device.type == "cuda"
        rng = torch.Generator(device=self.device)
        rng.manual_seed(secrets.randbits(63) if seed is None else seed)
        self.speculator = Speculator(
            target, self.guard, controller, self.scheduler, k_max, rng, accept
        )

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecParams | None = None,
        group: str | None = None,
    ) -> Sequence:
        """Queue a request. ``group``: the client request it belongs to (choices of one request
        share it; the scheduler caps what one group holds at once)."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.target.max_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit the context "
                f"({self.target.max_len} tokens)"
            )
        if not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError("prompt token id outside the vocabulary")
        if params.deterministic and self.deterministic == "off":
            raise ValueError("deterministic mode is off on this engine")
        matcher = None
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine has no grammar compiler (structured outputs)")
            matcher = self.grammars.matcher(params.grammar)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        seq = Sequence(
            request_id,
            list(prompt_ids),
            params,
            spec or SpecParams(),
            gen,
            arrival=time.perf_counter(),
            group=group or request_id,
            matcher=matcher,
        )
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        spec: SpecParams | list[SpecParams] | None = None,
        on_step: Callable[[list[StepOutput]], None] | None = None,
    ) -> list[Sequence]:
        """Run ``prompts`` together to completion (tests, benchmarks, the CLI demo)."""
        n = len(prompts)
        params = params if isinstance(params, list) else [params] * n
        spec = spec if isinstance(spec, list) else [spec or SpecParams()] * n
        seqs = [
            self.add_request(f"gen-{i}", p, sp, s)
            for i, (p, sp, s) in enumerate(zip(prompts, params, spec))
        ]
        while self.has_work():
            outs = self.step()
            if on_step:
                on_step(outs)
        return seqs

    # -- one engine step --------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        sched = self.scheduler
        self._calibrate_once()
        sched.make_room()  # the running sequences' next verifies fit the KV budget
        new, last_logits, outputs = self._prefill(sched.schedule_prefill())
        if new:
            firsts = self.speculator.first_tokens(new, torch.cat(last_logits))
            outputs = firsts + outputs
        for out in outputs:  # a sequence's first output carries its prompt's scores
            assert out.seq is not None
            if not out.seq.resumed:  # a recomputed one sent them before its preemption
                out.prompt_logprobs = out.seq.prompt_logprobs
        sched.start_running(new)
        if sched.running:
            outputs += self.speculator.round(sched.running, self._invariant(sched.running))
            sched.retire()
        return outputs

    def _prefill(
        self, chunks: list[PrefillChunk]
    ) -> tuple[list[Sequence], list[torch.Tensor], list[StepOutput]]:
        """The chunks' forwards, several chunks to one (prefill.py). Returns the sequences whose
        prompt is now complete (with the choices that share their prefill) and their last logits
        ``[1, vocab]`` each, in the chunks' order, and the outputs of those that finish here
        (max_tokens = 0)."""
        sched = self.scheduler
        solo = self.deterministic != "off" or not self.group_prefill  # deterministic: alone
        cap = sched.prefill_chunk_tokens
        last = run_chunks(self.target, self.guard, chunks, cap, solo, self._invariant)
        new, last_logits, scored = [], [], []
        for c in chunks:
            sched.prefilled(c)
            if not c.completes:
                continue
            done = [c.seq] + sched.followers(c.seq)  # choices sharing this prefill
            for f in done[1:]:
                if self.guard is not None:
                    self.guard.fork(c.seq, f)
                if c.seq.prompt_logprobs is not None:
                    f.prompt_logprobs = list(c.seq.prompt_logprobs)
            for s in done:
                if s.params.max_tokens == 0:  # prefill only: the prompt scored
                    sched.finish(s, "length")
                    scored.append(StepOutput(s.request_id, [], True, "length", seq=s))
                else:
                    new.append(s)
                    last_logits.append(last[id(c)])
        return new, last_logits, scored

    def _invariant(self, seqs: list[Sequence]) -> bool:
        """Whether the target's forwards over rows ``seqs`` are the batch-invariant ones: the
        engine always runs them, or a row asked (every forward of a deterministic request,
        chunks and rounds, is then invariant)."""
        mode = self.deterministic
        return mode == "always" or (mode == "request" and any(s.params.deterministic for s in seqs))

    def _calibrate_once(self) -> None:
        """Before the first request the controller decides K for, if :meth:`warm_up` did not:
        time forwards on free slots."""
        if self.controller.calibrated or not self.target.cache.num_free():
            return
        if any(s.spec.enabled and s.spec.k is None for s in self.scheduler.waiting):
            self._calibrate()

    def _calibrate(self) -> None:
        draft = self.drafter.runner if self.drafter is not None else None
        free = self.target.cache.free_slots()
        # "always": the forwards timed are the invariant ones
        self.controller.calibrate(self.target, draft, free, self._invariant([]))

    # -- compile warm-up ----------------------------------------------------------------------
    def runners(self) -> list[ModelRunner]:
        """The target's runner, then the draft model's when the drafter has one."""
        draft = self.drafter.runner if self.drafter is not None else None
        return [self.target] + ([draft] if draft is not None else [])

    def forward_paths(self) -> dict[str, str]:
        """The path each forward takes now, by component: ``target``, ``draft`` (a draft
        model's runner), ``head`` (the drafter's own step): see ModelRunner.path and the
        drafters' ``own_path``. A compile or capture that failed shows here as ``eager``."""
        paths = {"target": self.target.path()}
        draft = self.drafter.runner if self.drafter is not None else None
        if draft is not None:
            paths["draft"] = draft.path()
        own = self.drafter.own_path() if self.drafter is not None else None
        if own is not None:
            paths["head"] = own
        return paths

    def needs_warm_up(self) -> bool:
        return any(r.fast is not None for r in self.runners())

    def warm_up(self) -> None:
        """Compile and run every shape of the target's and draft model's fast forward path
        (engine/model/compiled.py) and the drafter's own, then time the forwards the K
        controller prices rounds by (its calibration). The worker calls it first."""
        for runner in self.runners():
            runner.warm_up()
        if self.drafter is not None:
            try:
                self.drafter.warm_up()
            except Exception as e:  # noqa: BLE001 -- its rounds fail over to plain ones later
                logging.getLogger("specd.engine").warning("drafter warm-up failed: %r", e)
        paths = ", ".join(f"{k} {v}" for k, v in self.forward_paths().items())
        logging.getLogger("specd.engine").warning("forward paths after warm-up: %s", paths)
        if not self.controller.calibrated and not self.scheduler.has_work():
            # the timing of forwards the K controller needs, before the server is ready rather
            # than in the first request's wait (its forwards are the fast path's, now compiled)
            self._calibrate()

    # -- what the worker reads (engine/worker/worker.py's Engine protocol) -------------------
    @property
    def lossless(self) -> bool:
        """True when the acceptance rule is the exact rejection rule (the worker serves no
        other)."""
        return self.speculator.accept is rejection_sample

    @property
    def drafter_failures(self) -> int:
        """Drafter faults so far (each made a plain round for its rows; drafters/guard.py)."""
        return self.guard.failures if self.guard is not None else 0

    @property
    def num_slots(self) -> int:
        """Sequences that can hold a KV slot at once."""
        return self.target.cache.num_slots

    @property
    def waiting(self) -> list[Sequence]:
        return list(self.scheduler.waiting)

    @property
    def prefilling(self) -> list[Sequence]:
        return self.scheduler.prefilling

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    def load(self) -> EngineLoad:
        cache, sched = self.target.cache, self.scheduler
        prefix = sched.prefix
        return EngineLoad(
            running=len(sched.running) + len(sched.prefilling),
            waiting=len(sched.waiting),
            kv_used_tokens=cache.used_tokens(),
            kv_free_slots=cache.num_free(),
            kv_slots=cache.num_slots,
            drafter_failures=self.drafter_failures,
            prefix_queries=prefix.queries if prefix is not None else 0,
            prefix_hits=prefix.hits if prefix is not None else 0,
            prefix_cache_tokens=prefix.tokens if prefix is not None else 0,
            kv_budget_tokens=sched.kv_budget,
            preemptions=sched.preemptions,
        )

    def held_ids(self) -> list[str]:
        """Request ids of the sequences holding a slot (prefilling or running)."""
        return [s.request_id for s in (*self.scheduler.running, *self.scheduler.prefilling)]

    def waiting_ids(self) -> list[str]:
        """Request ids of the sequences queued for a slot."""
        return [s.request_id for s in self.scheduler.waiting]
