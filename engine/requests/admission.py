"""Admission to the engine worker, and how a request there can end without its output.

:class:`Reservation` is the room a request holds in the worker from admission
(:meth:`engine.worker.worker.EngineWorker.reserve`) until its answer is over. Refusals at admission:
:class:`QueueFullError` (HTTP 429), :class:`NotAcceptingError` (503: warming up, not running, or
draining). After admission: :class:`EngineError` (the engine failed; 500) and its
:class:`DrainTimeoutError` (the drain's deadline passed first; 503).
"""

from __future__ import annotations

from collections.abc import Callable


class EngineError(RuntimeError):
    """The engine failed while running a request (the request is over)."""


class QueueFullError(RuntimeError):
    """More requests in flight than running slots + queue allow (the server answers 429)."""


class NotAcceptingError(RuntimeError):
    """The worker is not running, is warming up or is shutting down (the server answers 503)."""


class DrainTimeoutError(EngineError):
    """The drain's deadline passed before this request finished (the server answers 503)."""


class Reservation:
    """Room for ``count`` requests in a worker, from :meth:`EngineWorker.reserve` until
    :meth:`release` (idempotent; also on leaving a ``with`` block)."""

    def __init__(self, count: int, give_back: Callable[[int], None]):
        self.count, self._give_back = count, give_back

    def release(self) -> None:
        count, self.count = self.count, 0
        if count:
            self._give_back(count)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
