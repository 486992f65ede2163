"""The temps of checkpoint and best-model writes, and removing those that killed writes left.

A write killed before its rename (a ``.pt`` file's, a manifest's, a sharded checkpoint's
folder, a best model's file or Hugging Face folder) leaves its temp in the checkpoint
directory or ``save_path``, full size. Its writer holds an ``flock`` on it while it lives
(:func:`lock_temp`; :func:`~fastdist.checkpoint.files.atomic_file` locks its file), which the
kernel releases when the process ends, however it ends. So a temp of this naming that no one
holds locked is a dead write's: :func:`remove_stale` removes it, and :func:`clean` says so.
(A best model's Hugging Face folder is not locked: a run removes its temps only as it starts,
holding ``save_path``'s lock, when no write of its own is under way.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat

from fastdist.logging import logger

#: The checkpoint temps' names: ``.tmp-<hex>-step-00000120.pt`` and ``.tmp-<hex>-manifest.json``
#: (of ``atomic_file``; ``-step-00000240``: a checkpoint imported from a mirror) and
#: ``.tmp-step-00000240`` (a sharded checkpoint's folder). A best model's are
#: ``.tmp-<hex>-best_...`` (a file, or its Hugging Face folder).
TEMP_NAME = re.compile(r"\.tmp-([0-9a-f]{32}-(step-\d+(\.pt)?|manifest\.json)|step-\d{8})$")
#: The length of ``.tmp-<32 hex>-``, before the name of what a temp replaces.
PREFIX = len(".tmp-") + 32 + 1


def lock_temp(path: str) -> int:
    """An open descriptor of the temp file or folder ``path`` holding its ``flock``: the mark
    of a live writer, until it is closed (or the process ends)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def remove_stale(
    directory: str, pattern: re.Pattern[str] = TEMP_NAME
) -> tuple[list[str], int, list[str]]:
    """Remove the temps in ``directory`` (named as ``pattern`` says, and of the kind the name
    says: a sharded write's folder, a best model's file or folder, else a regular file) that
    no live writer holds locked:
    return their names, the bytes freed, and those it could not remove (with why). Nothing
    else is touched."""
    removed, freed, kept = [], 0, []
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if not pattern.match(name) or not _of_its_kind(path, name):
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # gone meanwhile
                continue
            except OSError as exc:
                kept.append(f"{name} ({exc.strerror or exc})")
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises where a writer lives
            except OSError as exc:
                os.close(fd)
                if not isinstance(exc, BlockingIOError):  # else a live writer's
                    kept.append(f"{name} ({exc.strerror or exc})")
                continue
            try:
                size = _size(path)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except OSError as exc:  # not ours to remove (permissions, immutable)
                kept.append(f"{name} ({exc.strerror or exc})")
                continue
            finally:
                os.close(fd)
            removed.append(name)
            freed += size
    return removed, freed, kept


def clean(
    directory: str, writes: str = "checkpoint", pattern: re.Pattern[str] = TEMP_NAME
) -> list[str]:
    """:func:`remove_stale` in ``directory``, logging what it removed and what it could not
    (temps of ``writes``); return the names removed."""
    removed, freed, kept = remove_stale(directory, pattern)
    if removed:
        logger.info(
            "removed %d temp(s) of %s writes that were killed (%s) from %s: %s",
            len(removed),
            writes,
            readable(freed),
            directory,
            ", ".join(removed),
        )
    if kept:
        logger.warning(
            "could not remove %d temp(s) of %s writes that were killed from %s: %s; "
            "remove them yourself (they take disk space)",
            len(kept),
            writes,
            directory,
            ", ".join(kept),
        )
    return removed


def readable(size: int) -> str:
    """``size`` bytes in KiB, MiB or GiB (bytes below 1 KiB), three significant digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def _of_its_kind(path: str, name: str) -> bool:
    """Whether ``path`` is what its name says: a folder (``.tmp-step-N``), a regular file or
    a folder (a best model's), else a regular file; a link is neither."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # gone meanwhile
        return False
    if name.startswith(".tmp-step-"):
        return stat.S_ISDIR(mode)
    best = name[PREFIX:].startswith("best_")
    return stat.S_ISREG(mode) or (best and stat.S_ISDIR(mode))


def _size(path: str) -> int:
    """The bytes of the file, or of the files in the folder, ``path``."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    )
