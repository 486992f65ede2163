"""Noting a SIGTERM (pre-emption, or torchrun stopping the job) instead of dying at once."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from fastdist.logging import logger

#: Seconds a rank waits, after SIGTERM, for the ranks to agree to stop (at the next log step,
#: evaluation or checkpoint) before it exits on its own: less than the 30 s torchrun leaves
#: before SIGKILL, which it sends once a rank failed and the others are stopped.
GRACE_S = 20.0
#: The exit code of a rank stopped by SIGTERM: 128 + 15, as if killed by the signal.
SIGTERM_EXIT_CODE = 143


class SigtermFlag:
    """``with flag.watching():`` sets ``flag.received`` on SIGTERM; the old handler returns
    afterwards. Outside the main thread (where signals cannot be handled) it watches nothing.

    The ranks act on the flag once they agree at a sync point. A rank that has not agreed
    :data:`GRACE_S` seconds after the signal (a peer died, or this rank is stuck far from a
    sync point) logs why and exits with :data:`SIGTERM_EXIT_CODE`; :meth:`settle` cancels that.
    """

    def __init__(self) -> None:
        self.received = False
        self._deadline: threading.Timer | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum: int, frame: Any) -> None:
            if not self.received:
                self.received = True
                self._deadline = threading.Timer(GRACE_S, _give_up)
                self._deadline.daemon = True
                self._deadline.start()

        previous = signal.signal(signal.SIGTERM, note)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.settle()

    def settle(self) -> None:
        """The ranks agreed to stop (or training is over): no deadline any more."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def _give_up() -> None:
    logger.error(
        "SIGTERM received %.0f s ago and the ranks have not agreed to stop: a peer is gone, or "
        "the next log step (print_every) is further away than that; exiting with %d, without a "
        "checkpoint",
        GRACE_S,
        SIGTERM_EXIT_CODE,
    )
    sys.stderr.flush()
    os._exit(SIGTERM_EXIT_CODE)
