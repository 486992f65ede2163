"""How DataLoader worker processes start, and the fork hazard of older Pythons.

By default (``multiprocessing_context=None``) workers start as torch starts them: forked, on
Linux. A rank forks while gloo's threads run, and each of them takes a Python lock when it
frees a finished collective's tensors. Before CPython 3.11.10 (3.10.15), a fork at that
moment leaves the lock held in the child, which then hangs before running any code (CPython
gh-112275; seen here about once in 100 forks made right after a DDP update). ``"forkserver"``
forks the workers from a server process that runs no other threads: it needs the training
script to keep its work under ``if __name__ == "__main__":``, since each worker imports it.
"""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any

from fastdist.logging import logger

CONTEXTS = (None, "fork", "forkserver", "spawn")
#: The first release of each affected minor version with gh-112275 fixed.
_FIXED = {(3, 10): 15, (3, 11): 10}


def worker_context(name: str | None) -> Any:
    """The ``multiprocessing_context`` to give a DataLoader for ``name`` (``None``: torch's
    default). ``"forkserver"`` preloads torch and fastdist into the server, so that a worker
    forked from it starts in 0.03 s instead of 1.3 s (measured here)."""
    if name == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "fastdist"])
    return None if name is None else multiprocessing.get_context(name)


def fork_may_hang(version: tuple[int, int, int] = sys.version_info[:3]) -> bool:
    """Whether this Python can hang a child forked while another thread starts a Python
    thread state (CPython gh-112275)."""
    fixed = _FIXED.get(version[:2])
    return fixed is not None and version[2] < fixed


def warn_if_fork_may_hang(name: str | None, num_workers: int, world_size: int) -> None:
    """One warning where forked workers of a multi-process job may hang on this Python."""
    if num_workers and world_size > 1 and name in (None, "fork") and fork_may_hang():
        version = ".".join(map(str, sys.version_info[:3]))
        logger.warning(
            "num_workers=%d with %d processes on Python %s: a DataLoader worker forked while "
            "gloo's threads free a collective's tensors can hang before it starts (CPython "
            "gh-112275, fixed in 3.11.10 and 3.10.15). Upgrade Python, or pass "
            "multiprocessing_context='forkserver' (the script's work under "
            "if __name__ == '__main__':)",
            num_workers,
            world_size,
            version,
        )
