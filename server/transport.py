"""Connection limits, in uvicorn's h11 protocol (:class:`SpecdH11`):

* request heads: a connection must deliver a complete request head within ``header_timeout_s``
  seconds of connecting or of its previous response (slowloris), else it is closed; h11's
  ``max_incomplete_event_size`` bounds the head's size (uvicorn answers 400 past it);
* stalled readers: a connection whose client has taken nothing of a response for
  ``stream_send_timeout_s`` seconds (the transport's write buffer stayed above its high-water
  mark) is dropped. The app sees an ordinary disconnect: a stream's request is aborted in the
  engine and its buffer freed, and nothing is logged as an error. Until then a stalled reader
  costs the engine nothing (engine/worker/channel.py bounds each request's buffer).

Body size and body time are server/middleware.py's. :func:`uvicorn_config` puts it together with a
short keep-alive.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import ServerSettings

log = logging.getLogger("specd.server")


class SpecdH11(H11Protocol):
    header_timeout: float = 10.0
    send_timeout: float = 60.0
    _head_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None

    # -- request heads ------------------------------------------------------------------------
    def _arm_head(self) -> None:
        self._disarm_head()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_deadline)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_deadline(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete  # no request head yet
        if idle and not self.transport.is_closing():
            self.transport.close()

    # -- stalled readers ----------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_deadline)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send()

    def _disarm_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_deadline(self) -> None:
        self._send_timer = None
        log.info("dropped a connection whose client took nothing for %g s", self.send_timeout)
        self.transport.abort()  # now, its unsent bytes with it; connection_lost follows

    # -- the connection -----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head()

    def connection_lost(self, exc) -> None:
        self._disarm_head()
        self._disarm_send()
        super().connection_lost(exc)


PROBES = ("/health", "/ready", "/metrics")  # polled by orchestrators and scrapers: not logged


class NoProbes(logging.Filter):
    """Drops uvicorn's access-log lines of the probes (:data:`PROBES`): a kubelet and a gateway
    poll them every few seconds, which would bury every other line."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in PROBES  # (client, method, path, ...)
        return True


def quiet_probes() -> None:
    """uvicorn's access logger drops the probes' lines (once per process)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, NoProbes) for f in access.filters):
        access.addFilter(NoProbes())


def uvicorn_config(app, settings: ServerSettings, **kw) -> uvicorn.Config:
    """uvicorn's config for ``app`` with specd's connection limits (host and port included,
    for a server that binds its own socket); its access log as ``settings.access_log`` says,
    never for the probes."""
    protocol = type(
        "SpecdH11Configured",
        (SpecdH11,),
        {
            "header_timeout": settings.header_timeout_s,
            "send_timeout": settings.stream_send_timeout_s,
        },
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=protocol,
        # (uvicorn annotates an int; a float works)
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=settings.max_header_bytes,
        log_level=settings.log_level,
        access_log=settings.access_log,
        **kw,
    )
    quiet_probes()  # (after uvicorn configured its loggers)
    return config
