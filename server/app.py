"""The FastAPI application: OpenAI-compatible routes over an :class:`EngineWorker`."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.worker import EngineError, EngineWorker, NotAcceptingError, QueueFullError

from . import protocol as P
from .convert import APIError, Job, Limits, chat_job, check_model, completion_job
from .generation import ChoiceEvent, JobRun
from .limits import BodyLimits, StalledReaderSSE
from .metrics import Metrics
from .settings import ServerSettings

log = logging.getLogger("specd.server")


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorBody(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def error_event(message: str, type: str = "server_error", code: str | None = None) -> dict:
    return {
        "data": json.dumps(
            {"error": {"message": message, "type": type, "param": None, "code": code}}
        )
    }


GENERATION_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

# documented responses (the OpenAPI schema is what clients and schemathesis check against)
_ERRORS = {
    400: "invalid request",
    401: "missing or wrong API key (when keys are set)",
    408: "request body too slow",
    413: "request body too large",
    429: "request queue full",
    503: "engine not ready",
}
ERROR_RESPONSES = {
    code: {"model": P.ErrorResponse, "description": d} for code, d in _ERRORS.items()
}
GENERATION_RESPONSES = {
    200: {
        "description": "the response; with stream=true, server-sent events: "
        "data: <chunk JSON> ... data: [DONE] (an error mid-stream: data: "
        "<error JSON>, then data: [DONE])"
    },
    **ERROR_RESPONSES,
}
STREAM_CHUNKS = {
    "/v1/completions": P.CompletionResponse,
    "/v1/chat/completions": P.ChatCompletionChunk,
}


def _sse_event_schema(chunk: str) -> dict:
    """One server-sent event (OpenAPI < 3.2: a text/event-stream schema describes each event)."""
    ref = lambda name: {"$ref": f"#/components/schemas/{name}"}  # noqa: E731
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [ref(chunk), ref("ErrorResponse")]},
                    },
                ]
            }
        },
    }


def _finish_schema(schema: dict) -> dict:
    """FastAPI documents 422 for every body: specd answers validation errors with 400, so 422
    goes; the streamed form of the generation responses is added (event schema per route)."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for path in schema.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for route, model in STREAM_CHUNKS.items():
        defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in defs.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps.setdefault(model.__name__, defs)
        ok = schema["paths"][route]["post"]["responses"]["200"].setdefault("content", {})
        ok["text/event-stream"] = {"schema": _sse_event_schema(model.__name__)}
    return schema


def create_app(
    worker: EngineWorker,
    tokenizer,
    model_name: str,
    limits: Limits,
    settings: ServerSettings,
    metrics: Metrics | None = None,
) -> FastAPI:
    app = FastAPI(
        title="specd",
        version="0.1.0",
        description="OpenAI-compatible server with lossless speculative decoding",
    )
    served = settings.served_model_names or [model_name]
    started = int(time.time())
    app.state.worker = worker
    if metrics is None:
        metrics = Metrics(model_name, limits.drafter, limits.k_max)
    app.state.metrics = metrics

    def observe(on: bool) -> None:  # metrics follow the engine while the app runs
        if on and metrics.observe_step not in worker.observers:
            worker.observers.append(metrics.observe_step)
        elif not on and metrics.observe_step in worker.observers:
            worker.observers.remove(metrics.observe_step)

    observe(True)
    app.router.on_startup.append(lambda: observe(True))
    app.router.on_shutdown.append(lambda: observe(False))

    # -- errors in OpenAI's shape -------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        if err.get("type") == "json_invalid":
            why = str((err.get("ctx") or {}).get("error", ""))[:100]
            return error_response(
                400,
                f"request body is not valid JSON ({why})".replace(" ()", ""),
                "invalid_request_error",
                None,
                "invalid_json",
            )
        # drop "body" and pydantic's union-branch tags ("str", "list[int]", ...) from the path
        loc = [
            str(x)
            for x in err.get("loc", ())
            if x != "body"
            and not (
                isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict"))
            )
        ]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request")
        return error_response(
            400,
            f"{param}: {msg}" if param else msg,
            "invalid_request_error",
            param,
            "invalid_value",
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            e.status_code, "invalid_request_error"
        )
        if e.status_code == 400 and e.detail == "There was an error parsing the body":
            return error_response(
                400, "request body could not be parsed (not UTF-8 JSON)", kind, None, "invalid_json"
            )
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal server error", "server_error")

    # -- authentication, body size and time, request counts, CORS -----------------------------
    # middleware order, outermost first: CORS (when configured), Guard (API key, counts),
    # BodyLimits (reads the body: unauthenticated clients never get a body read)
    app.add_middleware(
        BodyLimits, max_bytes=settings.max_body_bytes, body_timeout=settings.body_timeout_s
    )
    keys = [k.encode() for k in settings.api_keys]

    def refusal(request: Request) -> JSONResponse | None:
        """401 without a valid API key (when keys are set)."""
        if keys and request.url.path.startswith("/v1/"):
            auth = request.headers.get("authorization", "")
            given = auth[7:].encode() if auth[:7].lower() == "bearer " else b""
            ok = False
            for k in keys:  # compare against every key: the time does not tell which matched
                ok |= hmac.compare_digest(given, k)
            if not ok:
                return error_response(
                    401,
                    "Incorrect or missing API key",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
        return None

    class Guard:
        """Pure ASGI (a BaseHTTPMiddleware would hide client disconnects from the routes):
        refusals, then the request; generation requests are counted by final status
        (refusals included; an exception counts 500)."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            request = Request(scope)
            endpoint = GENERATION_ROUTES.get(scope["path"]) if scope["method"] == "POST" else None
            refused = refusal(request)
            if refused is not None:
                await refused(scope, receive, send)
                if endpoint:
                    metrics.request(endpoint, refused.status_code)
                return
            status = [500]

            async def send_status(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await self.inner(scope, receive, send_status)
            finally:
                if endpoint:
                    metrics.request(endpoint, status[0])

    app.add_middleware(Guard)

    if settings.cors_origins:  # off unless configured, and then only for the listed origins
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            allow_credentials=False,
        )
    openapi = app.openapi
    app.openapi = lambda: _finish_schema(openapi())  # (idempotent on FastAPI's cached schema)

    # -- health, models, metrics ------------------------------------------------------------
    @app.get(
        "/metrics",
        responses={
            200: {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def prometheus_metrics():
        metrics.set_gauges(worker.stats())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", responses={503: ERROR_RESPONSES[503]})
    async def ready():
        if not (worker.running and worker.healthy and worker.warmed.is_set()):
            return error_response(503, "engine not ready", "server_error", None, "not_ready")
        return {"status": "ready", **worker.stats()}

    @app.get("/v1/models", response_model=P.ModelList, responses={401: ERROR_RESPONSES[401]})
    async def models():
        return P.ModelList(data=[P.ModelCard(id=n, created=started) for n in served])

    def require_ready():
        if not worker.running:
            raise APIError(503, "engine not ready", "server_error", None, "not_ready")

    # -- generation ---------------------------------------------------------------------------
    def usage(run: JobRun) -> P.Usage:
        t = run.tally
        return P.Usage(
            prompt_tokens=t.prompt_tokens,
            completion_tokens=t.completion_tokens,
            total_tokens=t.prompt_tokens + t.completion_tokens,
            speculation=P.SpeculationUsage(
                drafted_tokens=t.drafted, accepted_tokens=t.accepted, target_passes=t.passes
            ),
        )

    async def collect(request: Request, run: JobRun) -> list[list[ChoiceEvent]]:
        """All events of a non-streamed job; a client disconnect cancels (and so aborts) it."""
        n = len(run.job.prompts) * run.job.n
        per_choice: list[list[ChoiceEvent]] = [[] for _ in range(n)]

        async def consume():
            async for ev in run.events():
                per_choice[ev.index].append(ev)

        task = asyncio.create_task(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            raise APIError(499, "client disconnected", "invalid_request_error") from None
        except EngineError as e:
            raise APIError(500, str(e), "server_error") from None
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", None, "queue_full") from None
        except NotAcceptingError as e:
            raise APIError(503, str(e), "server_error", None, "not_ready") from None
        return per_choice

    def completion_logprobs(evs: list[ChoiceEvent], offset: int) -> P.CompletionLogprobs:
        lp = P.CompletionLogprobs()
        for ev in evs:
            for t in ev.logprobs or []:
                lp.tokens.append(t.token)
                lp.token_logprobs.append(t.logprob)
                lp.top_logprobs.append(dict(t.top))
                lp.text_offset.append(offset)
                offset += len(t.token)
        return lp

    def chat_logprobs(evs: list[ChoiceEvent]) -> P.ChoiceLogprobs:
        content = [
            P.TokenLogprob(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode()),
                top_logprobs=[
                    P.TopLogprob(token=s, logprob=v, bytes=list(s.encode())) for s, v in t.top
                ],
            )
            for ev in evs
            for t in ev.logprobs or []
        ]
        return P.ChoiceLogprobs(content=content)

    def start(job: Job, prefix: str) -> JobRun:
        try:
            worker.check_admission(len(job.prompts) * job.n)
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", None, "queue_full") from None
        except NotAcceptingError as e:
            raise APIError(503, str(e), "server_error", None, "not_ready") from None
        return JobRun(worker, tokenizer, job, f"{prefix}-{uuid.uuid4().hex}", metrics)

    def include_usage(req) -> bool:
        return bool(req.stream_options and req.stream_options.include_usage)

    def stream(body: AsyncIterator[dict]) -> StalledReaderSSE:
        """SSE response; an engine failure mid-stream becomes an error event, then [DONE]."""

        async def events():
            try:
                async for item in body:
                    yield item
            except (EngineError, QueueFullError, NotAcceptingError) as e:
                yield error_event(str(e))
            yield {"data": "[DONE]"}

        return StalledReaderSSE(
            events(), ping=15, sep="\n", send_timeout=settings.stream_send_timeout_s
        )

    @app.post(
        "/v1/completions", response_model=P.CompletionResponse, responses=GENERATION_RESPONSES
    )
    async def completions(req: P.CompletionRequest, request: Request):
        check_model(req.model, served)
        require_ready()
        job = completion_job(req, tokenizer, settings, limits)
        run = start(job, "cmpl")
        created = int(time.time())
        prompt_texts = [tokenizer.decode(p, skip_special_tokens=False) for p in job.prompts]

        if not req.stream:
            per_choice = await collect(request, run)
            choices = []
            for i, evs in enumerate(per_choice):
                prefix = prompt_texts[i // job.n] if job.echo else ""
                text = prefix + "".join(e.text for e in evs)
                lp = completion_logprobs(evs, len(prefix)) if req.logprobs is not None else None
                choices.append(
                    P.CompletionChoice(
                        index=i,
                        text=text,
                        logprobs=lp,
                        finish_reason=evs[-1].finish_reason if evs else None,
                    )
                )
            return P.CompletionResponse(
                id=run.request_id,
                created=created,
                model=req.model,
                choices=choices,
                usage=usage(run),
            )

        async def gen():
            def chunk(choices, usage_=None):
                return {
                    "data": P.CompletionResponse(
                        id=run.request_id,
                        created=created,
                        model=req.model,
                        choices=choices,
                        usage=usage_,
                    ).model_dump_json(exclude_unset=False)
                }

            if job.echo:
                for i in range(len(job.prompts) * job.n):
                    yield chunk([P.CompletionChoice(index=i, text=prompt_texts[i // job.n])])
            offsets: dict[int, int] = {}
            async for ev in run.events():
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs([ev], offsets.get(ev.index, 0))
                    offsets[ev.index] = offsets.get(ev.index, 0) + len(ev.text)
                yield chunk(
                    [
                        P.CompletionChoice(
                            index=ev.index,
                            text=ev.text,
                            logprobs=lp,
                            finish_reason=ev.finish_reason,
                        )
                    ]
                )
            if include_usage(req):
                yield chunk([], usage(run))

        return stream(gen())

    @app.post(
        "/v1/chat/completions",
        response_model=P.ChatCompletionResponse,
        responses=GENERATION_RESPONSES,
    )
    async def chat(req: P.ChatCompletionRequest, request: Request):
        check_model(req.model, served)
        require_ready()
        job = chat_job(req, tokenizer, settings, limits)
        run = start(job, "chatcmpl")
        created = int(time.time())

        if not req.stream:
            per_choice = await collect(request, run)
            choices = [
                P.ChatChoice(
                    index=i,
                    message=P.AssistantMessage(content="".join(e.text for e in evs)),
                    logprobs=chat_logprobs(evs) if req.logprobs else None,
                    finish_reason=evs[-1].finish_reason if evs else None,
                )
                for i, evs in enumerate(per_choice)
            ]
            return P.ChatCompletionResponse(
                id=run.request_id,
                created=created,
                model=req.model,
                choices=choices,
                usage=usage(run),
            )

        async def gen():
            def chunk(choices, usage_=None):
                return {
                    "data": P.ChatCompletionChunk(
                        id=run.request_id,
                        created=created,
                        model=req.model,
                        choices=choices,
                        usage=usage_,
                    ).model_dump_json()
                }

            for i in range(job.n):
                yield chunk(
                    [P.ChatChunkChoice(index=i, delta=P.Delta(role="assistant", content=""))]
                )
            async for ev in run.events():
                delta = P.Delta(content=ev.text) if ev.text else P.Delta()
                yield chunk(
                    [
                        P.ChatChunkChoice(
                            index=ev.index,
                            delta=delta,
                            finish_reason=ev.finish_reason,
                            logprobs=chat_logprobs([ev]) if req.logprobs else None,
                        )
                    ]
                )
            if include_usage(req):
                yield chunk([], usage(run))

        return stream(gen())

    return app
