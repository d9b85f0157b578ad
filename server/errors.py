"""Errors in OpenAI's shape: the API error type, the one builder of error bodies, and the one
mapping from engine / worker exceptions to API errors.

Every error specd answers, as a response or as a stream's error event, is
``{"error": {"message", "type", "param", "code"}}`` built by :func:`error_body`. Its text never
holds a stack trace, a file path or an exception's own text unless that exception is one of the
worker's (:mod:`engine.worker.worker`), whose messages are written for clients; anything else
answers ``500 internal server error`` and its detail goes to the log.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.api import DrainTimeoutError, EngineError, NotAcceptingError, QueueFullError

log = logging.getLogger("specd.server")

RETRY_AFTER_S = 1  # what a 429 or 503 asks the client to wait (OpenAI's SDKs honour Retry-After)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a request specd cannot honour, naming the field."""
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(sent_a_key: bool) -> APIError:
    """401 in OpenAI's own type, code and wording: SDKs map the status to AuthenticationError,
    and litellm reads "Incorrect API key provided" as an authentication failure."""
    why = "" if sent_a_key else " (none was sent)"
    return APIError(
        401,
        f"Incorrect API key provided{why}. Send a valid key as 'Authorization: Bearer <key>'.",
        "invalid_request_error",
        None,
        "invalid_api_key",
    )


NOT_READY = "not_ready"


def from_exception(e: BaseException) -> APIError:
    """The one mapping from what a request can raise to the API error it answers."""
    if isinstance(e, APIError):
        return e
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", None, "queue_full", retry)
    if isinstance(e, NotAcceptingError):  # warming up or draining: another replica can answer
        return APIError(503, str(e), "server_error", None, NOT_READY, retry)
    if isinstance(e, DrainTimeoutError):
        return APIError(503, str(e), "server_error", None, "shutting_down", retry)
    if isinstance(e, EngineError):
        return APIError(500, str(e), "server_error")
    return APIError(500, "internal server error", "server_error")


def error_body(err: APIError) -> dict:
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def error_event(err: APIError) -> dict:
    """The error as one server-sent event (a stream that already answered 200)."""
    return {"data": json.dumps(error_body(err))}


def _validation_error(e: RequestValidationError) -> APIError:
    err: dict = dict(e.errors()[0]) if e.errors() else {"msg": "invalid request", "loc": ()}
    if err.get("type") == "json_invalid":
        why = str((err.get("ctx") or {}).get("error", ""))[:100]
        message = f"request body is not valid JSON ({why})".replace(" ()", "")
        return bad(message, None, "invalid_json")
    # drop "body" and pydantic's union-branch tags ("str", "list[int]", ...) from the path
    loc = [
        str(x)
        for x in err.get("loc", ())
        if x != "body"
        and not (isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "dict")))
    ]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    return bad(f"{param}: {msg}" if param else msg, param, "invalid_value")


def _http_error(e: StarletteHTTPException) -> APIError:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    if e.status_code == 400 and e.detail == "There was an error parsing the body":
        why = "request body could not be parsed (not UTF-8 JSON)"
        return APIError(400, why, kind, None, "invalid_json")
    return APIError(e.status_code, str(e.detail), kind)


def answer(e: Exception) -> JSONResponse:
    """The response to an exception a route raised (internal ones logged)."""
    err = from_exception(e)
    if err.status == 500 and not isinstance(e, (APIError, EngineError)):
        log.error("unhandled error", exc_info=e)
    return error_response(err)


def install_handlers(app: FastAPI) -> None:
    """Every exception a route raises answers in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        return error_response(_validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return error_response(_http_error(e))

    @app.exception_handler(Exception)
    async def _any(_, e: Exception):
        return answer(e)

    for kind in (APIError, EngineError, QueueFullError, NotAcceptingError):
        app.add_exception_handler(kind, _any)
