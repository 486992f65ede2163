"""One run at a time in a ``save_path`` and in a ``checkpoint_dir``: rank 0 holds an exclusive
lock on each while it trains.

The lock is ``fcntl.flock`` on ``<directory>/.fastdist.lock``, which holds the pid and host of
the holder. The operating system releases it when the holding process ends, however it ends,
so a crashed or killed run leaves no stale lock and its restart is never blocked. A second run
that finds it held fails at its start, on every rank alike (agreed as checkpoint writes are),
naming the argument, its directory and the holder. ``flock`` is advisory and may not lock
across the nodes of some network file systems (NFS before Linux 2.6.12 locks locally only).
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
def hold_dirs(dirs: dict[str, str | None], group: Any) -> Iterator[None]:
    """Hold the lock of each directory of ``dirs`` (argument name: path; ``None`` skipped) on
    rank 0 for the ``with`` block; a collective of every rank, which raise the same ``OSError``
    if another process holds one."""
    paths = {os.path.realpath(path): name for name, path in dirs.items() if path}
    held = agreed(lambda: _lock_all(paths) if get_rank() == 0 else [], group)
    try:
        yield
    finally:
        for file in held:
            _held.remove(file)
            file.close()  # releases the lock


def _lock_all(paths: dict[str, str]) -> list[IO[str]]:
    """The lock files of ``paths`` (real path: argument name), all locked, or none."""
    files: list[IO[str]] = []
    try:
        for path, name in paths.items():
            files.append(_lock(path, name))
    except OSError:
        for file in files:
            _held.remove(file)
            file.close()
        raise
    return files


def _lock(path: str, name: str) -> IO[str]:
    """The open lock file of directory ``path`` (the argument ``name``), locked; raise
    ``BlockingIOError`` naming its holder if another process holds it."""
    os.makedirs(path, exist_ok=True)
    file = open(os.path.join(path, LOCK_FILE), "a+", encoding="utf-8")  # noqa: SIM115
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        raise BlockingIOError(
            f"{name}={path!r} is in use by another run ({holder}): two runs in one {name} "
            "would overwrite each other's checkpoints (and a resume would continue the other "
            f"run's model); wait for that run to end, or pass another {name}",
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
