"""OpenAI response objects from a job's events, shared by the generation routes: the envelope
of a response or a stream chunk, usage, logprobs, and the event stream itself.

A streamed response answers server-sent events: the route's chunks, then ``[DONE]``; an
exception after the 200 becomes one error event (server/errors.py's mapping), then ``[DONE]``.
The request's reservation (its admission) is released when the response ends, however it ends:
completed, failed, disconnected, or dropped by the transport for a reader that stalled.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from pydantic import BaseModel
from sse_starlette.sse import EventSourceResponse

from engine.api import EngineError, Reservation

from . import protocol as P
from .errors import error_event, from_exception
from .generation import ChoiceEvent, JobRun
from .tool_stream import ToolOutputReader
from .tools import ToolMode, finish_reason, read_output

log = logging.getLogger("specd.server")

PING_S = 15  # keep-alive comment lines on a quiet stream


def usage(run: JobRun) -> P.Usage:
    t = run.tally
    return P.Usage(
        prompt_tokens=t.prompt_tokens,
        completion_tokens=t.completion_tokens,
        total_tokens=t.prompt_tokens + t.completion_tokens,
        prompt_tokens_details=P.PromptTokensDetails(cached_tokens=t.cached_tokens),
        speculation=P.SpeculationUsage(
            drafted_tokens=t.drafted,
            accepted_tokens=t.accepted,
            target_passes=t.passes,
            tree_leaves=t.leaves,
            leaf_accepts=t.leaf_accepts,
        ),
    )


def envelope(cls: type[BaseModel], run: JobRun, model: str, created: int, fingerprint: str):
    """``cls(id, created, model, system_fingerprint, choices, usage)`` for this run: a
    response or a stream chunk."""

    def build(choices: list, usage: P.Usage | None = None):
        return cls(
            id=run.response_id or run.request_id,
            created=created,
            model=model,
            system_fingerprint=fingerprint,
            choices=choices,
            usage=usage,
        )

    return build


def completion_logprobs(evs: list[ChoiceEvent], offset: int) -> P.CompletionLogprobs:
    """The legacy logprobs object of these events: the prompt's tokens first when they were
    scored (echo: the first with null logprob and alternatives, as OpenAI answers), then the
    generated ones; ``text_offset`` counts characters from ``offset``."""
    lp = P.CompletionLogprobs()
    for ev in evs:
        for t in (ev.prompt_logprobs or []) + (ev.logprobs or []):
            lp.tokens.append(t.token)
            lp.token_logprobs.append(t.logprob)
            lp.top_logprobs.append(dict(t.top) if t.logprob is not None else None)
            lp.text_offset.append(offset)
            offset += len(t.token)
    return lp


def chat_logprobs(evs: list[ChoiceEvent]) -> P.ChoiceLogprobs:
    content = [
        P.TokenLogprob(
            token=t.token,
            logprob=t.logprob if t.logprob is not None else 0.0,  # (chat never scores a prompt)
            bytes=list(t.token.encode()),
            top_logprobs=[
                P.TopLogprob(token=s, logprob=v, bytes=list(s.encode())) for s, v in t.top
            ],
        )
        for ev in evs
        for t in ev.logprobs or []
    ]
    return P.ChoiceLogprobs(content=content)


def stream_chunks(
    run: JobRun,
    build: Callable,
    head: list,
    choices: Callable[[ChoiceEvent], Sequence[BaseModel]],
    with_usage: bool,
) -> AsyncGenerator[dict, None]:
    """The chunks of a streamed response: one per ``head`` choice (role deltas, echoed
    prompts), one per choice ``choices(event)`` gives for each event, then usage when asked."""

    async def chunks():
        def data(choices: list, usage: P.Usage | None = None) -> dict:
            return {"data": build(choices, usage).model_dump_json()}

        for c in head:
            yield data([c])
        async with aclosing(run.events()) as events:
            async for ev in events:
                for c in choices(ev):
                    yield data([c])
        if with_usage:
            yield data([], usage(run))

    return chunks()


def tool_choices(mode: ToolMode) -> Callable[[ChoiceEvent], list[BaseModel]]:
    """A tool-mode chat stream's chunk choices per event, as the model writes (read by
    server/tool_stream.py): a call's ``delta.tool_calls`` entry with its index, id and name
    once the name is whole, then its arguments in pieces; a plain answer's text as content.
    At the end, an output that did not read as either (cut by max_tokens) goes out whole as
    content, as the non-streamed answer has it; then the finish reason."""
    readers: dict[int, ToolOutputReader] = {}

    def choices(ev: ChoiceEvent) -> list[BaseModel]:
        reader = readers.setdefault(ev.index, ToolOutputReader())
        reader.feed(ev.text)
        out: list[BaseModel] = []
        for k, call, first, new in reader.take_calls():
            fn = P.FunctionCallDelta(name=call.name if first else None, arguments=new)
            d = P.ToolCallDelta(index=k, function=fn)
            if first:  # the call's first delta: its id and type too
                d = P.ToolCallDelta(index=k, id=call.id, type="function", function=fn)
            out.append(P.ChatChunkChoice(index=ev.index, delta=P.Delta(tool_calls=[d])))
        if text := reader.take_content():
            out.append(P.ChatChunkChoice(index=ev.index, delta=P.Delta(content=text)))
        if not ev.finish_reason:
            return out
        content, calls = read_output(reader.text)
        if content is not None and calls is None and not reader.streamed_anything:
            out.append(P.ChatChunkChoice(index=ev.index, delta=P.Delta(content=content)))
        reason = finish_reason(mode, calls, ev.finish_reason)
        last = P.ChatChunkChoice(
            index=ev.index, delta=P.Delta(), finish_reason=reason, stop_reason=ev.stop_reason
        )
        out.append(last)
        return out

    return choices


async def _events(body: AsyncGenerator[dict, None]) -> AsyncGenerator[dict, None]:
    try:
        async with aclosing(body) as items:
            async for item in items:
                yield item
    except Exception as e:  # answered as an error event; internal ones logged
        err = from_exception(e)
        if err.status == 500 and not isinstance(e, EngineError):
            log.error("unhandled error mid-stream", exc_info=e)
        yield error_event(err)
    yield {"data": "[DONE]"}


class EventStream(EventSourceResponse):
    """A streamed response over ``body``'s events, holding ``reservation`` until it ends."""

    def __init__(self, body: AsyncGenerator[dict, None], reservation: Reservation):
        super().__init__(_events(body), ping=PING_S, sep="\n")
        self.reservation = reservation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.reservation.release()
