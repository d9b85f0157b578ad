"""specd's ASGI middleware, outermost first: :class:`RequestId` (X-Request-Id), :class:`Guard`
(API keys, request counts), then :class:`BodyLimits` (how long and how much a client may send).
All are pure ASGI: a ``BaseHTTPMiddleware`` would hide client disconnects from the routes.

* :class:`RequestId`: a request's id is its ``X-Request-Id`` header where that is a valid id
  (:data:`ID_PATTERN`), else one made here (a route may set it from the body's ``request_id``
  first: :func:`set_request_id`); every response carries it back as ``X-Request-Id``, a
  generation response's ``id`` is made from it (server/routes.py), and specd.server's log lines
  written while the request is served end with it (:class:`RequestIdLog`).

* :class:`Guard`: with API keys set, every ``/v1/*`` request needs ``Authorization: Bearer
  <key>``, compared in constant time against every key (the time does not tell which matched);
  otherwise 401 before anything else runs, so unauthenticated clients never get a body read.
  Generation requests are counted by final status (refusals included; an exception counts 500).
* :class:`BodyLimits`: a request body must arrive whole within ``body_timeout`` seconds (else
  408) and hold at most ``max_bytes`` (else 413: at once when the declared Content-Length is
  larger, or as soon as a chunked body passes it). The body is read here and replayed to the
  app, so no route ever reads a slow or oversized body.

The connection-level limits (request head deadline, stalled sends) are server/transport.py's.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import re
import uuid
from collections.abc import Callable

from .errors import APIError, answer, error_response, unauthorized

# the request being served in this task (its X-Request-Id): in specd.server's log lines
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
# an id a client may give (header or body): bounded, and nothing a log line could be forged with
ID_PATTERN = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

BODY_METHODS = ("POST", "PUT", "PATCH")


class Guard:
    def __init__(
        self,
        app,
        api_keys: list[str],
        endpoints: dict[str, str],
        count: Callable[[str, int], None],
    ):
        """``endpoints``: POST path -> endpoint label of the requests ``count(label, status)``
        counts."""
        self.app, self.keys = app, [k.encode() for k in api_keys]
        self.endpoints, self.count = endpoints, count

    def refusal(self, scope) -> APIError | None:
        if not self.keys or not scope["path"].startswith("/v1/"):
            return None
        auth = dict(scope["headers"]).get(b"authorization", b"")
        given = auth[7:] if auth[:7].lower() == b"bearer " else b""
        ok = False
        for k in self.keys:  # every key is compared, whichever matches
            ok |= hmac.compare_digest(given, k)
        return None if ok else unauthorized(bool(given))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = self.endpoints.get(scope["path"]) if scope["method"] == "POST" else None
        refused = self.refusal(scope)
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            if endpoint:
                self.count(endpoint, refused.status)
            return None
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            if endpoint:
                self.count(endpoint, status[0])


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class BodyLimits:
    def __init__(self, app, max_bytes: int, body_timeout: float):
        self.app, self.max_bytes, self.body_timeout = app, max_bytes, body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        close = {"connection": "close"}
        message = f"request body larger than {self.max_bytes} bytes"
        too_large = APIError(413, message, code="request_too_large", headers=close)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(too_large)(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout)
        except asyncio.TimeoutError:
            message = f"request body not received within {self.body_timeout:g} s"
            slow = APIError(408, message, code="request_timeout", headers=close)
            return await error_response(slow)(scope, receive, send)
        except _TooLarge:
            return await error_response(too_large)(scope, receive, send)
        except _Disconnected:
            return None
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later: http.disconnect

        return await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes:
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Disconnected
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)


class RequestId:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        valid = ID_PATTERN.fullmatch(given) is not None
        state = scope.setdefault("state", {})
        state["request_id"] = given if valid else uuid.uuid4().hex
        state["request_id_given"] = valid
        REQUEST_ID.set(state["request_id"])  # (the request's own task: its context ends with it)
        started = False

        async def send_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                headers.append((b"x-request-id", state["request_id"].encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_id)
        except Exception as e:  # an unhandled one: answered here, so with its X-Request-Id
            if started:
                raise
            await answer(e)(scope, receive, send_id)


def set_request_id(state, body_id: str | None) -> str:
    """The request's id: its header's; else the body's ``request_id`` (vLLM's field), which the
    response then carries back; else the one :class:`RequestId` made. 400 for a body id that is
    not a valid id."""
    if body_id is not None and not state.request_id_given:
        if ID_PATTERN.fullmatch(body_id) is None:
            raise APIError(400, f"request_id must match {ID_PATTERN.pattern}", param="request_id")
        state.request_id = body_id
        REQUEST_ID.set(body_id)
    return state.request_id


class RequestIdLog(logging.Filter):
    """Ends a log line written while a request is served with ``[request <id>]``."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        if rid is not None and not getattr(record, "request_id", None):
            record.request_id = rid
            record.msg = f"{record.msg} [request {rid}]"
        return True
