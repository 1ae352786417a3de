"""One-line progress and one-time notices through :mod:`logging` (logger ``jcompilemask``).

Both go out at WARNING so that they show without any logging set up (Python prints
WARNING and above by default); each says something once, so they do not repeat in a
training loop. Silence them with ``logging.getLogger("jcompilemask").setLevel(logging.ERROR)``.
"""
from __future__ import annotations

import contextlib
import logging
import threading

__all__ = ["logger", "slow_step", "log_once"]

logger = logging.getLogger("jcompilemask")

SLOW_AFTER_S = 1.0
_said: set = set()
_said_lock = threading.Lock()


@contextlib.contextmanager
def slow_step(what: str, after: float | None = None):
    """Log ``"<what> ... (cached after this)"`` once the block has run ``after`` seconds.

    The line is written from a timer while the work is still running, so a long compile
    is announced while the user waits, not after it; a fast block logs nothing.
    """
    timer = threading.Timer(SLOW_AFTER_S if after is None else after, logger.warning,
                            args=("%s; it is cached after this call", what))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def log_once(key, msg: str, *args) -> bool:
    """Log ``msg`` at WARNING the first time ``key`` is seen; True if it was logged."""
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
    logger.warning(msg, *args)
    return True
