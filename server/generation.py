"""Runs the choices of one HTTP request through the engine worker and turns engine outputs into
text events: incremental detokenization, stop strings, logprobs, usage counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from engine.worker import EngineError, EngineWorker

from .convert import Job
from .metrics import Metrics
from .textstream import IncrementalDetokenizer, StopFilter


@dataclass
class TokenLP:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[TokenLP] | None = None
    finish_reason: str | None = None


@dataclass
class Tally:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0


@dataclass
class JobRun:
    """All choices of one job: ``len(prompts) * n`` engine requests, merged into one stream."""

    worker: EngineWorker
    tokenizer: object
    job: Job
    request_id: str
    metrics: Metrics | None = None
    started: float = field(default_factory=time.perf_counter)  # when the HTTP request came in
    tally: Tally = field(default_factory=Tally)

    def _token_text(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    async def _choice(self, index: int, prompt: list[int]) -> AsyncIterator[ChoiceEvent]:
        """One choice's events; its latencies and finish reason go to the metrics."""
        clock = self.metrics.sequence_clock(self.started) if self.metrics else None
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(prompt))
        reason = "abort"  # unless it finishes: the consumer went away
        try:
            async for ev in self._choice_events(index, prompt, clock):
                if ev.finish_reason:
                    reason = ev.finish_reason
                yield ev
        except EngineError:
            reason = "error"
            raise
        finally:
            if clock:
                clock.done(reason)

    async def _choice_events(
        self, index: int, prompt: list[int], clock
    ) -> AsyncIterator[ChoiceEvent]:
        job, tok = self.job, self.tokenizer
        detok = IncrementalDetokenizer(tok, prompt)
        stops = StopFilter(job.stop)
        self.tally.prompt_tokens += len(prompt)
        want_lp = job.params.logprobs is not None
        params = job.params
        if params.seed is not None and index:  # n choices of one seeded request must differ
            params = replace(params, seed=params.seed + index)
        async for out in self.worker.submit(f"{self.request_id}-{index}", prompt, params, job.spec):
            if clock:
                clock.tokens(len(out.new_token_ids), out.seq)
            self.tally.completion_tokens += len(out.new_token_ids)
            if out.stats is not None:
                self.tally.drafted += out.stats.drafted
                self.tally.accepted += out.stats.accepted
            self.tally.passes += out.passes
            text = stops.feed(detok.add(out.new_token_ids, final=out.finished), final=out.finished)
            lps = None
            if want_lp and out.logprobs is not None:
                tops = out.top_logprobs or [[] for _ in out.new_token_ids]
                lps = [
                    TokenLP(self._token_text(t), lp, [(self._token_text(i), v) for i, v in top])
                    for t, lp, top in zip(out.new_token_ids, out.logprobs, tops)
                ]
            if stops.stopped:
                yield ChoiceEvent(index, text, lps, "stop")
                return  # leaving the iterator aborts the engine request
            reason = None
            if out.finished:
                reason = "length" if out.finish_reason == "length" else "stop"
            if text or lps or reason:
                yield ChoiceEvent(index, text, lps, reason)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Events of every choice, interleaved as they come; choice index = prompt * n + i."""
        gens = [
            self._choice(p * self.job.n + i, prompt)
            for p, prompt in enumerate(self.job.prompts)
            for i in range(self.job.n)
        ]
        if len(gens) == 1:
            async for ev in gens[0]:
                yield ev
            return
        # bounded: when the reader stalls the pumps stop, and each engine channel merges outputs
        q: asyncio.Queue = asyncio.Queue(maxsize=4 * len(gens))
        done = object()

        async def pump(g):
            try:
                async for ev in g:
                    await q.put(ev)
                await q.put(done)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # forwarded to the consumer
                await q.put(e)
            finally:
                await g.aclose()  # (cancelled at q.put: g's cleanup, the engine abort, runs now)

        tasks = [asyncio.create_task(pump(g)) for g in gens]
        remaining = len(tasks)
        try:
            while remaining:
                item = await q.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
