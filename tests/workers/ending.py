"""How a test worker ends once its ``main`` returned: as Python would, less the final teardown
of every module (about 1 s a process once torch is loaded, on the 2-core CI machine; each
launched world pays it per rank). What that teardown does that a test can see runs first:
the threads are shut down and joined as at exit, the ``atexit`` handlers run (fastdist's,
torch's, logging's flush), stdout and stderr are flushed. A worker that raises ends as Python
ends it, with its traceback (one pre-empted, with ``SystemExit``, as :func:`exit_from` ends
it); examples and fastdist itself exit normally."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int | None = 0) -> NoReturn:
    """Exit with ``code`` (``None``: 0) after the threads and the ``atexit`` handlers."""
    # What the interpreter calls first at exit: the threading atexit hooks (a thread pool's
    # shutdown: inductor compiles in one), then a join of every non-daemon thread.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def exit_from(main: Callable[[], int | None]) -> NoReturn:
    """Run ``main`` and :func:`exit_now` with what it returned, or with the code of the
    ``SystemExit`` it raised: a pre-empted trainer's (143), its checkpoint already written."""
    try:
        code = main()
    except SystemExit as stop:
        code = int(stop.code or 0)
    exit_now(code)
