"""How a faster path that failed says so: what failed, the error's type and first line, and what
serves instead, as one warning. A failed compile, capture or kernel build never stops the server
(the slower path computes the same tokens); it is logged once, where it happens."""

from __future__ import annotations

import logging


def warn_fallback(logger: logging.Logger, what: str, err: BaseException, instead: str) -> None:
    """Log that ``what`` failed with ``err`` and that ``instead`` serves from now on."""
    text = str(err).strip()
    first = text.splitlines()[0][:300] if text else ""
    logger.warning("%s failed (%s: %s); %s", what, type(err).__name__, first, instead)
