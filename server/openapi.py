"""The documented responses of specd's routes: what ``/openapi.json`` promises (clients and
schemathesis check the server against it). Errors are OpenAI's shape; validation errors answer
400, not FastAPI's 422; a generation route streamed answers server-sent events, each a chunk of
that route's type or an error, up to ``[DONE]``."""

from __future__ import annotations

from pydantic import BaseModel

from . import protocol as P

_ERRORS = {
    400: "invalid request",
    401: "missing or wrong API key (when keys are set)",
    404: "no such model (code model_not_found)",
    408: "request body too slow",
    413: "request body too large",
    429: "request queue full (retry after Retry-After seconds)",
    503: "engine not ready",
}
ERROR_RESPONSES: dict = {
    code: {"model": P.ErrorResponse, "description": d} for code, d in _ERRORS.items()
}
ERROR_RESPONSES[429]["headers"] = {
    "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
}
GENERATION_RESPONSES: dict = {
    200: {
        "description": "the response; with stream=true, server-sent events: "
        "data: <chunk JSON> ... data: [DONE] (an error mid-stream: data: "
        "<error JSON>, then data: [DONE])"
    },
    **ERROR_RESPONSES,
}
STREAM_CHUNKS: dict[str, type[BaseModel]] = {
    "/v1/completions": P.CompletionResponse,
    "/v1/chat/completions": P.ChatCompletionChunk,
}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _sse_event_schema(chunk: str) -> dict:
    """One server-sent event (OpenAPI < 3.2: a text/event-stream schema describes each event)."""
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
                        "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]},
                    },
                ]
            }
        },
    }


def finish_schema(schema: dict) -> dict:
    """FastAPI's schema, finished: 422 goes (specd answers validation errors with 400), the
    streamed form of the generation responses is added (event schema per route). Idempotent."""
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
