"""specd's ASGI middleware, outermost first: :class:`Guard` (API keys, request counts), then
:class:`BodyLimits` (how long and how much a client may send). Both are pure ASGI: a
``BaseHTTPMiddleware`` would hide client disconnects from the routes.

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
import hmac
from collections.abc import Callable

from .errors import APIError, error_response, unauthorized

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
