"""The generation routes, ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Each request, in order: the model name is checked, the request is converted (server/convert.py,
400s), then admitted: :meth:`~engine.worker.worker.EngineWorker.reserve` takes room for all its
choices at once, before any byte of the response, or refuses (429 with Retry-After when the queue is
full, 503 when the engine is not ready). A streamed answer holds that room until the stream ends
(server/responses.py); a plain one until its JSON is built. A client that disconnects aborts its
choices in the engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from engine.api import EngineWorker, GrammarCompiler

from . import protocol as P
from .convert import EngineCapacity, Job, chat_job, check_model, completion_job
from .errors import APIError
from .generation import ChoiceEvent, JobRun
from .metrics import Metrics
from .middleware import set_request_id
from .openapi import GENERATION_RESPONSES
from .responses import (
    EventStream,
    chat_logprobs,
    completion_logprobs,
    envelope,
    stream_chunks,
    tool_choices,
    usage,
)
from .settings import ServerSettings
from .tools import finish_reason, read_output

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # metrics labels
DISCONNECT_POLL_S = 0.5  # how often a plain (non-streamed) request checks for its client


@dataclass
class Serving:
    """What the routes serve with."""

    worker: EngineWorker
    tokenizer: Any
    served: list[str]  # model names this server answers to
    capacity: EngineCapacity
    settings: ServerSettings
    metrics: Metrics
    fingerprint: str  # OpenAI's system_fingerprint: this build, model and drafter
    grammars: GrammarCompiler | None  # checks structured-output grammars before admission


def admit(s: Serving, job: Job, prefix: str, client_id: str) -> JobRun:
    """Reserve room for every choice of ``job`` (raises the worker's refusals). The response's
    id is ``prefix-client_id`` (the request's X-Request-Id, as vLLM makes it); the engine's
    requests get ids of their own, so two requests that send one id never share one there."""
    reservation = s.worker.reserve(len(job.prompts) * job.n)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    run = JobRun(s.worker, s.tokenizer, job, request_id, reservation, s.metrics)
    run.response_id = f"{prefix}-{client_id}"
    return run


async def collect(request: Request, run: JobRun) -> list[list[ChoiceEvent]]:
    """All events of a plain request, per choice; a client disconnect cancels (so aborts) it.
    Releases the request's reservation."""
    per_choice: list[list[ChoiceEvent]] = [[] for _ in range(len(run.job.prompts) * run.job.n)]

    async def consume():
        async for ev in run.events():
            per_choice[ev.index].append(ev)

    with run.reservation:
        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            raise APIError(499, "client disconnected", "invalid_request_error") from None
    return per_choice


def _finish(evs: list[ChoiceEvent]) -> str | None:
    return evs[-1].finish_reason if evs else None


def _stop_reason(evs: list[ChoiceEvent]) -> int | str | None:
    return evs[-1].stop_reason if evs else None


def _vllm_prompt_logprobs(evs: list[ChoiceEvent]):
    return next((e.vllm_prompt_logprobs for e in evs if e.vllm_prompt_logprobs is not None), None)


def add_generation_routes(app: FastAPI, s: Serving) -> None:
    @app.post(
        "/v1/completions", response_model=P.CompletionResponse, responses=GENERATION_RESPONSES
    )
    async def completions(req: P.CompletionRequest, request: Request):
        client_id = set_request_id(request.state, req.request_id)
        check_model(req.model, s.served)
        job = completion_job(req, s)
        prompts = [s.tokenizer.decode(p, skip_special_tokens=False) for p in job.prompts]
        run = admit(s, job, "cmpl", client_id)
        build = envelope(P.CompletionResponse, run, req.model, int(time.time()), s.fingerprint)
        want_lp = req.logprobs is not None

        if req.stream:
            # echo: the prompt's text leads each choice (with logprobs, in the chunk that carries
            # the prompt's scores: they exist once the prompt is prefilled)
            echo_first = job.echo and not want_lp
            echoed = [
                P.CompletionChoice(index=i, text=prompts[i // job.n])
                for i in range(len(prompts) * job.n)
            ]
            offsets: dict[int, int] = {}

            def choice(ev: ChoiceEvent) -> P.CompletionChoice:
                text, lp = ev.text, None
                if job.echo and ev.prompt_logprobs is not None:
                    text = prompts[ev.index // job.n] + text
                if want_lp:
                    lp = completion_logprobs([ev], offsets.get(ev.index, 0))
                    if lp.tokens:
                        offsets[ev.index] = lp.text_offset[-1] + len(lp.tokens[-1])
                return P.CompletionChoice(
                    index=ev.index,
                    text=text,
                    logprobs=lp,
                    finish_reason=ev.finish_reason,
                    stop_reason=ev.stop_reason,
                )

            head = echoed if echo_first else []
            chunks = stream_chunks(run, build, head, lambda ev: [choice(ev)], include_usage(req))
            return EventStream(chunks, run.reservation)

        choices = []
        for i, evs in enumerate(await collect(request, run)):
            prefix = prompts[i // job.n] if job.echo else ""
            lp = completion_logprobs(evs, 0) if want_lp else None
            text = prefix + "".join(e.text for e in evs)
            choices.append(
                P.CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=lp,
                    finish_reason=_finish(evs),
                    stop_reason=_stop_reason(evs),
                    prompt_logprobs=_vllm_prompt_logprobs(evs),
                )
            )
        return build(choices, usage(run))

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses=GENERATION_RESPONSES,
    )
    async def chat(req: P.ChatCompletionRequest, request: Request):
        client_id = set_request_id(request.state, req.request_id)
        check_model(req.model, s.served)
        job = chat_job(req, s)
        run = admit(s, job, "chatcmpl", client_id)
        created = int(time.time())

        if req.stream:
            build = envelope(P.ChatCompletionChunk, run, req.model, created, s.fingerprint)
            roles = [
                P.ChatChunkChoice(index=i, delta=P.Delta(role="assistant", content=""))
                for i in range(job.n)
            ]
            if job.chat_echo:  # vLLM's echo: the last assistant message leads each answer
                roles += [
                    P.ChatChunkChoice(index=i, delta=P.Delta(content=job.chat_echo))
                    for i in range(job.n)
                ]

            def choice(ev: ChoiceEvent) -> P.ChatChunkChoice:
                return P.ChatChunkChoice(
                    index=ev.index,
                    delta=P.Delta(content=ev.text) if ev.text else P.Delta(),
                    finish_reason=ev.finish_reason,
                    stop_reason=ev.stop_reason,
                    logprobs=chat_logprobs([ev]) if req.logprobs else None,
                )

            per_event = (
                tool_choices(job.tools) if job.tools is not None else lambda ev: [choice(ev)]
            )
            chunks = stream_chunks(run, build, roles, per_event, include_usage(req))
            return EventStream(chunks, run.reservation)

        choices = []
        scored = None  # vLLM's prompt_logprobs of the conversation (every choice has them)
        for i, evs in enumerate(await collect(request, run)):
            scored = scored or _vllm_prompt_logprobs(evs)
            text = "".join(e.text for e in evs)
            content: str | None = job.chat_echo + text
            calls = None
            reason = _finish(evs)
            if job.tools is not None:  # the answer's JSON read as calls or content
                content, calls = read_output(text)
                reason = finish_reason(job.tools, calls, reason)
            choices.append(
                P.ChatChoice(
                    index=i,
                    message=P.AssistantMessage(content=content, tool_calls=calls),
                    logprobs=chat_logprobs(evs) if req.logprobs else None,
                    finish_reason=reason,
                    stop_reason=_stop_reason(evs),
                )
            )
        build = envelope(P.ChatCompletionResponse, run, req.model, created, s.fingerprint)
        response = build(choices, usage(run))
        if scored is not None:
            response.prompt_logprobs = P.PROMPT_LOGPROBS.validate_python(scored)
        return response


def include_usage(req: P.CompletionRequest | P.ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
