"""How a test worker ends once its ``main`` returned: as Python would, less the final teardown
of every module (about 1 s a process once torch is loaded, on the 2-core CI machine; each
launched world pays it per rank). What that teardown does that a test can see runs first:
non-daemon threads are joined, the ``atexit`` handlers run (fastdist's, torch's, logging's
flush), stdout and stderr are flushed. A worker that raises ends as Python ends it, with its
traceback; examples and fastdist itself exit normally."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | None = 0) -> NoReturn:
    """Exit with ``code`` (``None``: 0) after the threads and the ``atexit`` handlers."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
