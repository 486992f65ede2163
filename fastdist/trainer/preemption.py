"""Noting a SIGTERM (pre-emption, or torchrun stopping the job) instead of dying at once."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class SigtermFlag:
    """``with flag.watching():`` sets ``flag.received`` on SIGTERM; the old handler returns
    afterwards. Outside the main thread (where signals cannot be handled) it watches nothing.
    """

    def __init__(self) -> None:
        self.received = False

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum: int, frame: Any) -> None:
            self.received = True

        previous = signal.signal(signal.SIGTERM, note)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
