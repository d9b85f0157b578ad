"""Transport limits: how long and how much a client may send.

* :class:`BodyLimits` (ASGI middleware): a request body must arrive whole within
  ``body_timeout`` seconds (else 408) and hold at most ``max_bytes`` (else 413: at once when the
  declared Content-Length is larger, or as soon as a chunked body passes it). The body is read
  here and replayed to the app, so no route ever reads a slow or oversized body.
* :class:`HeaderDeadlineH11` (uvicorn protocol): a connection must deliver a complete request
  head within ``header_timeout`` seconds of connecting or of its previous response (slowloris);
  h11's ``max_incomplete_event_size`` bounds the head's size (uvicorn answers 400 past it).
* :class:`StalledReaderSSE`: a streamed response whose client has not taken a single write for
  ``send_timeout`` seconds is closed (the request is aborted and its buffer freed); until then a
  stalled reader costs the engine nothing (engine/worker.py bounds each request's buffer).
* :func:`uvicorn_config` puts them together with a short keep-alive.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("specd.server")

BODY_METHODS = ("POST", "PUT", "PATCH")


def error_json(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": code,
            }
        },
        status,
        headers=headers,
    )


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
        too_large = error_json(
            413,
            f"request body larger than {self.max_bytes} bytes",
            "request_too_large",
            {"connection": "close"},
        )
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.body_timeout)
        except asyncio.TimeoutError:
            return await error_json(
                408,
                f"request body not received within {self.body_timeout:g} s",
                "request_timeout",
                {"connection": "close"},
            )(scope, receive, send)
        except _TooLarge:
            return await too_large(scope, receive, send)
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


def _only_send_timeouts(e: BaseException) -> bool:
    subs = getattr(e, "exceptions", None)  # an exception group from the response's task group
    return isinstance(e, SendTimeoutError) or (bool(subs) and all(map(_only_send_timeouts, subs)))


class StalledReaderSSE(EventSourceResponse):
    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except Exception as e:
            if not _only_send_timeouts(e):
                raise
            log.warning("closed a stream whose client stopped reading for %s s", self.send_timeout)


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection that has not sent a complete request head
    within ``header_timeout`` seconds of connecting or of finishing its previous response."""

    header_timeout: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_deadline)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_deadline(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete  # no request head yet
        if idle and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app, host: str, port: int, settings, **kw) -> uvicorn.Config:
    protocol = type("SpecdH11", (HeaderDeadlineH11,), {"header_timeout": settings.header_timeout_s})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=settings.keep_alive_s,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        **kw,
    )
