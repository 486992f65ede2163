"""The temps of checkpoint writes, and removing those that killed writes left.

A write killed before its rename (a ``.pt`` file's, a manifest's, a sharded checkpoint's
folder) leaves its temp in the checkpoint directory, full size. Its writer holds an ``flock``
on it while it lives (:func:`lock_temp`; :func:`~fastdist.checkpoint.files.atomic_file` locks
its file), which the kernel releases when the process ends, however it ends. So a temp of this
naming that no one holds locked is a dead write's: :func:`remove_stale` removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil

#: The temps' names: ``.tmp-<hex>-step-00000120.pt`` and ``.tmp-<hex>-manifest.json`` (of
#: ``atomic_file``; ``-step-00000240``: a checkpoint imported from a mirror) and
#: ``.tmp-step-00000240`` (a sharded checkpoint's folder).
TEMP_NAME = re.compile(r"\.tmp-([0-9a-f]{32}-(step-\d+(\.pt)?|manifest\.json)|step-\d{8})$")


def lock_temp(path: str) -> int:
    """An open descriptor of the temp file or folder ``path`` holding its ``flock``: the mark
    of a live writer, until it is closed (or the process ends)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def remove_stale(directory: str) -> tuple[list[str], int]:
    """Remove the temps in ``directory`` (named as :data:`TEMP_NAME`) that no live writer holds
    locked: return their names and the bytes freed. Nothing else is touched."""
    removed, freed = [], 0
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(directory)):
            if not TEMP_NAME.match(name):
                continue
            path = os.path.join(directory, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # gone meanwhile
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises where a writer lives
                size = _size(path)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except OSError:  # a live writer's, or not ours to remove (permissions)
                continue
            finally:
                os.close(fd)
            removed.append(name)
            freed += size
    return removed, freed


def _size(path: str) -> int:
    """The bytes of the file, or of the files in the folder, ``path``."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )
