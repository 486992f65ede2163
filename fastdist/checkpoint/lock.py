"""One run at a time in a ``save_path``: rank 0 holds an exclusive lock on it while it trains.

The lock is ``fcntl.flock`` on ``<save_path>/.fastdist.lock``, which holds the pid and host of
the holder. The operating system releases it when the holding process ends, however it ends,
so a crashed or killed run leaves no stale lock and its restart is never blocked. A second run
that finds it held fails at its start, on every rank alike (agreed as checkpoint writes are),
naming the ``save_path`` and the holder. ``flock`` is advisory and may not lock across the nodes
of some network file systems (NFS before Linux 2.6.12 locks locally only).
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from fastdist.distributed import agreed, get_rank

LOCK_FILE = ".fastdist.lock"
_held: list[IO[str]] = []  # this process's locks


def _drop_in_child() -> None:
    """A forked child (a DataLoader worker) lets go of its copies of the lock files: a child
    that outlives a killed run would otherwise keep the lock from its restart."""
    for file in _held:
        file.close()  # only this process's reference; the parent keeps its lock
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


@contextmanager
def hold_save_path(save_path: str | None, group: Any) -> Iterator[None]:
    """Hold ``save_path``'s lock (rank 0) for the ``with`` block; a collective of every rank,
    which raise the same ``OSError`` if another process holds it."""
    held = agreed(lambda: _lock(save_path) if save_path and get_rank() == 0 else None, group)
    try:
        yield
    finally:
        if held is not None:
            _held.remove(held)
            held.close()  # releases the lock


def _lock(save_path: str) -> IO[str]:
    """The open lock file of ``save_path``, locked; raise ``BlockingIOError`` naming its
    holder if another process holds it."""
    os.makedirs(save_path, exist_ok=True)
    file = open(os.path.join(save_path, LOCK_FILE), "a+", encoding="utf-8")  # noqa: SIM115
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        raise BlockingIOError(
            f"save_path={save_path!r} is in use by another run ({holder}): two runs in one "
            "save_path would interleave its log and overwrite each other's checkpoints; wait "
            "for that run to end, or pass another save_path",
        ) from exc
    except OSError:
        file.close()
        raise
    file.seek(0)
    file.truncate()
    file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    file.flush()
    _held.append(file)
    return file
