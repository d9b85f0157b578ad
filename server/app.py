"""The FastAPI application: OpenAI-compatible routes over an :class:`EngineWorker`.

Routes: the generation routes (server/routes.py), ``GET /v1/models``, and, open without an API
key, ``GET /health`` (liveness: 200 while the process serves HTTP, draining included, unless
the engine loop has held requests for ``health_stall_s`` without coming round: 503),
``GET /ready`` (readiness: 503 until the engine loop runs, is warmed up and healthy, and again
from the moment a drain starts), ``GET /metrics`` (Prometheus) and vLLM's ``POST /tokenize``,
``POST /detokenize`` and ``GET /version`` (server/tokenize.py). Middleware, outermost
first: CORS (only when origins are configured), the request id (X-Request-Id), the API key
guard and request counts, body limits (server/middleware.py). Every error answers in OpenAI's
shape (server/errors.py).
"""

from __future__ import annotations

import hashlib
import logging
import time

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.api import EngineWorker, GrammarCompiler

from . import protocol as P
from .convert import EngineCapacity, check_model
from .errors import NOT_READY, APIError, error_response, install_handlers
from .metrics import Metrics
from .middleware import BodyLimits, Guard, RequestId, RequestIdLog
from .openapi import ERROR_RESPONSES, finish_schema
from .routes import ENDPOINTS, Serving, add_generation_routes
from .settings import ServerSettings
from .tokenize import add_tokenize_routes


def create_app(
    worker: EngineWorker,
    tokenizer,
    model_name: str,
    capacity: EngineCapacity,
    settings: ServerSettings,
    metrics: Metrics | None = None,
    grammars: GrammarCompiler | None = None,
) -> FastAPI:
    app = FastAPI(
        title="specd",
        version="0.1.0",
        description="OpenAI-compatible server with lossless speculative decoding",
    )
    served = settings.served_model_names or [model_name]
    started = int(time.time())
    # what answered: this build, model and drafter (OpenAI's system_fingerprint)
    built = f"specd {app.version} {model_name} {capacity.drafter} {capacity.k_max}"
    fingerprint = "fp_" + hashlib.sha256(built.encode()).hexdigest()[:10]
    app.state.worker = worker
    if metrics is None:
        metrics = Metrics(
            model_name,
            capacity.drafter,
            capacity.k_max,
            served_name=served[0],
            max_model_len=capacity.max_model_len,
            cache_info=capacity.cache_info,
        )
    app.state.metrics = metrics

    def observe(on: bool) -> None:  # metrics follow the engine while the app runs
        if on and metrics.observe_step not in worker.observers:
            worker.observers.append(metrics.observe_step)
        elif not on and metrics.observe_step in worker.observers:
            worker.observers.remove(metrics.observe_step)

    observe(True)
    app.router.on_startup.append(lambda: observe(True))
    app.router.on_shutdown.append(lambda: observe(False))

    install_handlers(app)
    # added innermost first: BodyLimits reads the body only for requests the Guard let in
    app.add_middleware(
        BodyLimits, max_bytes=settings.max_body_bytes, body_timeout=settings.body_timeout_s
    )
    app.add_middleware(
        Guard, api_keys=settings.api_keys, endpoints=ENDPOINTS, count=metrics.request
    )
    app.add_middleware(RequestId)  # outside the guard: a 401 carries its X-Request-Id too
    server_log = logging.getLogger("specd.server")
    if not any(isinstance(f, RequestIdLog) for f in server_log.filters):
        server_log.addFilter(RequestIdLog())
    if settings.cors_origins:  # off unless configured, and then only for the listed origins
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id"],
            allow_credentials=False,
        )
    openapi = app.openapi
    app.openapi = lambda: finish_schema(openapi())  # type: ignore[method-assign]

    page: list = [0.0, None]  # /metrics: (when, the rendered page)

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
        # one render serves every scrape within metrics_cache_s: a render holds the GIL for
        # milliseconds, which a gateway scraping every 50 ms would take from the engine
        now = time.monotonic()
        if page[1] is None or now - page[0] >= settings.metrics_cache_s:
            metrics.set_gauges(worker.stats())
            metrics.set_forward_paths(worker.forward_paths())
            page[:] = [now, generate_latest(metrics.registry)]
        return Response(page[1], media_type=CONTENT_TYPE_LATEST)

    @app.get("/health", responses={503: ERROR_RESPONSES[503]})
    async def health():
        stalled = worker.stalled_for()
        if stalled > settings.health_stall_s:  # liveness: a hung engine is restarted
            why = f"the engine made no progress for {stalled:.0f} s while holding requests"
            return error_response(APIError(503, why, "server_error", None, "engine_stalled"))
        return {"status": "ok"}

    @app.get("/ready", responses={503: ERROR_RESPONSES[503]})
    async def ready():
        if not worker.accepting:
            why = "the server is shutting down" if worker.draining else "engine not ready"
            not_ready = APIError(503, why, "server_error", None, NOT_READY)
            return error_response(not_ready)
        return {"status": "ready", **worker.stats()}

    @app.get("/v1/models", response_model=P.ModelList, responses={401: ERROR_RESPONSES[401]})
    async def models():
        return P.ModelList(data=[P.ModelCard(id=n, created=started) for n in served])

    @app.get(
        "/v1/models/{model:path}",
        response_model=P.ModelCard,
        responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]},
    )
    async def model(model: str):
        check_model(model, served)
        return P.ModelCard(id=model, created=started)

    if grammars is None:  # the engine's own; an engine without one serves no structured output
        grammars = getattr(getattr(worker, "engine", None), "grammars", None)
    serving = Serving(worker, tokenizer, served, capacity, settings, metrics, fingerprint, grammars)
    add_generation_routes(app, serving)
    add_tokenize_routes(app, tokenizer, served, capacity.max_model_len, capacity.vocab_size)
    return app
