"""Runs the choices of one HTTP request through the engine worker and turns engine outputs into
text events: incremental detokenization, stop strings, logprobs, usage counts.

Every choice is submitted under the request's one :class:`~engine.worker.worker.Reservation` (its
admission); leaving :meth:`JobRun.events` early, however it happens, aborts every choice still
running in the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api import EngineError, EngineWorker, Reservation, StepOutput

from .convert import Job
from .metrics import Metrics, SequenceClock
from .textstream import IncrementalDetokenizer, StopFilter


@dataclass
class TokenLP:
    token: str
    logprob: float | None  # None: the first prompt token (nothing to score it on)
    top: list[tuple[str, float]]


@dataclass
class ChoiceEvent:
    index: int
    text: str
    logprobs: list[TokenLP] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLP] | None = None  # echo + logprobs: on a choice's first event
    # vLLM's stop_reason, with finish_reason "stop": the stop string or stop token id that ended
    # the choice; None where the model's EOS ended it (or it did not stop)
    stop_reason: int | str | None = None
    # vLLM's prompt_logprobs (Job.prompt_logprobs), on a choice's first event: per prompt token
    # None (the first) or token id -> {"logprob", "rank", "decoded_token"}
    vllm_prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


@dataclass
class Tally:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, restored from the prefix cache
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    leaves: int = 0
    leaf_accepts: int = 0


def _text(
    out: StepOutput,
    detok: IncrementalDetokenizer,
    stops: StopFilter,
    before: int = 0,
    min_tokens: int = 0,
    include_stop: bool = False,
) -> tuple[str, int]:
    """The text of ``out``'s new tokens that may be sent, and how many of its tokens that text
    covers. With stop strings the tokens are read one at a time and the output ends at the
    token that completes a stop string, as plain decoding (one token a step) would end it: a
    speculative round that emitted tokens past it counts none of them (usage, logprobs).
    ``before``: the output's tokens before these; a stop string counts only once the output
    holds ``min_tokens`` tokens (vLLM's min_tokens). A stop token (the engine's "stop") is
    counted but its text is left out unless ``include_stop`` (vLLM's rule)."""
    ids, final = out.new_token_ids, out.finished
    shown = ids
    if final and out.finish_reason == "stop" and ids and not include_stop:
        shown = ids[:-1]  # the stop token's own text is not output
    if not stops.stops:
        return stops.feed(detok.add(shown, final=final), final=final), len(ids)
    text = ""
    for used, t in enumerate(shown, 1):
        last = final and used == len(ids)
        armed = before + used >= min_tokens
        text += stops.feed(detok.add([t], final=last), final=last, search=armed)
        if stops.stopped:
            return text, used
    if len(shown) < len(ids):  # the stop token: the held text goes out
        text += stops.feed(detok.add([], final=True), final=True)
    return text, len(ids)


@dataclass
class JobRun:
    """All choices of one job: ``len(prompts) * n`` engine requests, merged into one stream."""

    worker: EngineWorker
    tokenizer: Any
    job: Job
    request_id: str
    reservation: Reservation
    metrics: Metrics | None = None
    started: float = field(default_factory=time.perf_counter)  # when the HTTP request came in
    tally: Tally = field(default_factory=Tally)
    response_id: str = ""  # the response's id (server/routes.py ``admit``; "": request_id)
    clocks: dict[int, SequenceClock] = field(default_factory=dict)  # by choice index

    def _token_text(self, t: int) -> str:
        if self.job.token_ids:  # vLLM's return_tokens_as_token_ids
            return f"token_id:{t}"
        return self.tokenizer.decode([t], skip_special_tokens=False)

    async def _choice(self, index: int, prompt: list[int]) -> AsyncGenerator[ChoiceEvent, None]:
        """One choice's events; its latencies and finish reason go to the metrics."""
        clock = self.metrics.sequence_clock(self.started, len(prompt)) if self.metrics else None
        if clock:
            self.clocks[index] = clock
        if index % self.job.n == 0:  # a prompt counts once, however many choices share it
            self.tally.prompt_tokens += len(prompt)
            if self.metrics:
                self.metrics.prompt_tokens.inc(len(prompt))
        reason = "abort"  # unless it finishes: the consumer went away
        try:
            async with aclosing(self._choice_events(index, prompt, clock)) as events:
                async for ev in events:
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
    ) -> AsyncGenerator[ChoiceEvent, None]:
        job = self.job
        detok = IncrementalDetokenizer(self.tokenizer, prompt, job.skip_special)
        stops = StopFilter(job.stop, job.include_stop)
        made = 0  # output tokens so far
        params = job.params
        if params.seed is not None and index:  # n choices of one seeded request must differ
            params = replace(params, seed=params.seed + index)
        rid = f"{self.request_id}-{index}"
        submitted = self.worker.submit(
            rid, prompt, params, job.spec, self.reservation, group=self.request_id
        )
        first = index % job.n == 0  # a prompt's cached tokens count once, as its tokens do
        async with aclosing(submitted) as outputs:  # leaving early aborts the engine request
            async for out in outputs:
                if first and out.seq is not None:
                    self.tally.cached_tokens += out.seq.cached_tokens
                first = False
                if clock:
                    clock.tokens(len(out.new_token_ids), out.seq)
                text, used = _text(out, detok, stops, made, params.min_tokens, job.include_stop)
                made += used
                self._count(out, used)
                lps = self._logprobs(out, used)
                scored = self._prompt_logprobs(prompt, out)
                vllm_scored = self._vllm_prompt_logprobs(prompt, out)
                if stops.stopped:
                    yield ChoiceEvent(index, text, lps, "stop", scored, stops.matched, vllm_scored)
                    return
                reason, why = None, None
                if out.finished:
                    reason = "length" if out.finish_reason == "length" else "stop"
                    if reason == "stop" and out.new_token_ids:
                        why = self._stop_token(out.new_token_ids[-1])
                if text or lps or reason or scored or vllm_scored:
                    yield ChoiceEvent(index, text, lps, reason, scored, why, vllm_scored)

    def _stop_token(self, t: int) -> int | None:
        """vLLM's stop_reason for a choice ended by token ``t``: None for the tokenizer's EOS
        (unless ignore_eos: then only stop_token_ids stop it), else ``t`` itself -- one of
        stop_token_ids or another of the model's end tokens (generation_config's eos_token_id,
        which vLLM adds to stop_token_ids)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return None if t == eos and not self.job.params.ignore_eos else t

    def _count(self, out: StepOutput, used: int) -> None:
        self.tally.completion_tokens += used
        if out.stats is not None:
            self.tally.drafted += out.stats.drafted
            self.tally.accepted += out.stats.accepted
            self.tally.leaves += out.stats.leaves
            self.tally.leaf_accepts += out.stats.leaf_hit
        self.tally.passes += out.passes

    def _logprobs(self, out: StepOutput, used: int) -> list[TokenLP] | None:
        if self.job.params.logprobs is None or out.logprobs is None:
            return None
        tops = out.top_logprobs or [[] for _ in out.new_token_ids]
        text = self._token_text
        return [
            TokenLP(text(t), lp, [(text(i), v) for i, v in top])
            for t, lp, top in zip(out.new_token_ids[:used], out.logprobs, tops)
        ]

    def _prompt_logprobs(self, prompt: list[int], out: StepOutput) -> list[TokenLP] | None:
        """echo + logprobs: the prompt's tokens in the legacy logprobs (the top ``logprobs``;
        the engine may have scored more for prompt_logprobs)."""
        if out.prompt_logprobs is None or not self.job.echo or self.job.params.logprobs is None:
            return None
        text, n = self._token_text, self.job.params.logprobs
        return [
            TokenLP(text(t), None, [])
            if lp is None
            else TokenLP(text(t), lp.logprob, [(text(i), v) for i, v in lp.top[:n]])
            for t, lp in zip(prompt, out.prompt_logprobs)
        ]

    def _vllm_prompt_logprobs(
        self, prompt: list[int], out: StepOutput
    ) -> list[dict[int, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs: at each prompt token after the first, the token itself (its
        logprob, rank, text), then the top ``prompt_logprobs`` with ranks 1..N."""
        n = self.job.prompt_logprobs
        if n is None or out.prompt_logprobs is None:
            return None
        text = self._token_text
        rows: list[dict[int, dict[str, Any]] | None] = []
        for t, lp in zip(prompt, out.prompt_logprobs):
            if lp is None:
                rows.append(None)
                continue
            row = {t: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(t)}}
            for r, (i, v) in enumerate(lp.top[:n], 1):
                row.setdefault(i, {"logprob": v, "rank": r, "decoded_token": text(i)})
            rows.append(row)
        return rows

    async def events(self) -> AsyncGenerator[ChoiceEvent, None]:
        """Events of every choice, interleaved as they come; choice index = prompt * n + i."""
        try:
            async with aclosing(self._events()) as events:
                async for ev in events:
                    yield ev
        finally:
            self._observe_prompts()

    def _observe_prompts(self) -> None:
        """Per prompt, the output tokens of its longest choice (vLLM counts a prompt's ``n``
        choices as one request with a maximum)."""
        if not self.metrics or not self.clocks:
            return
        n = self.job.n
        for p in range(len(self.job.prompts)):
            made = [c.generated for i in range(n) if (c := self.clocks.get(p * n + i))]
            if made:
                self.metrics.request_max_generation_tokens.observe(max(made))

    async def _events(self) -> AsyncGenerator[ChoiceEvent, None]:
        gens = [
            self._choice(p * self.job.n + i, prompt)
            for p, prompt in enumerate(self.job.prompts)
            for i in range(self.job.n)
        ]
        if len(gens) == 1:
            async with aclosing(gens[0]) as events:
                async for ev in events:
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
            except Exception as e:  # noqa: BLE001 (forwarded to the consumer, who raises it)
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
