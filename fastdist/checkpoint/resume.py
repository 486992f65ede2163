"""Which checkpoint a run resumes from, chosen alike on every rank.

Rank 0 reads the manifest and applies the rule that nothing saved is deleted by a later run: a
run starts in a checkpoint directory that holds checkpoints only to continue them. The other
ranks receive its plan, or its error. Then every rank checks its share of a candidate's
checksums and loads the candidate's rest (``weights_only``); one all-gather per candidate tells
every rank whether all of them succeeded. So every rank loads the same checkpoint, or raises
the same error, before any rank enters a collective that the others would not join.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from fastdist.checkpoint.files import CheckpointDir, crc32, expected_checksums, load_checkpoint
from fastdist.checkpoint.sharded import checked_metadata
from fastdist.checks import first_line
from fastdist.distributed import all_gather_object, broadcast_object, get_rank, get_world_size
from fastdist.logging import logger

#: The errors rank 0's plan may end in, raised as the same type on every rank.
_ERRORS: dict[str, type[Exception]] = {
    error.__name__: error
    for error in (FileExistsError, FileNotFoundError, PermissionError, ValueError)
}


@dataclass(frozen=True)
class Candidate:
    """A checkpoint to try, with the CRC-32 its manifest records for each file (by path)."""

    path: str
    checksums: dict[str, int]


@dataclass(frozen=True)
class Plan:
    """Rank 0's reading of ``resume``: the candidates, newest first, or the error to raise."""

    candidates: list[Candidate]
    explicit: bool = False  # resume=<path>: a failed check is an error, not a fallback
    rollback: bool = False  # newer checkpoints of the directory were set aside
    error: tuple[str, str] | None = None  # (exception type, message)


#: Brings a newer checkpoint into the directory before an "auto" resume (a mirror's fetch).
Fetch = Callable[[CheckpointDir], None]


def choose(
    resume: bool | str | os.PathLike,
    directory: CheckpointDir | None,
    group: Any,
    fetch: Fetch | None = None,
) -> tuple[dict[str, Any], str, bool] | None:
    """The checkpoint ``train(resume=...)`` continues from, loaded (its rest; the shards stay
    on disk), its path and whether it is a rollback (newer checkpoints of the directory were
    set aside); ``None`` to start afresh (no checkpoint, or ``resume=False``). A collective of
    every rank, which raise alike where checkpoints are and none can be resumed. With
    ``"auto"``, rank 0 first calls ``fetch`` (if any) on the directory."""
    rank, world_size = get_rank(), get_world_size()
    plan = _plan_or_error(resume, directory, fetch) if rank == 0 else None
    plan = broadcast_object(plan, group=group)
    if plan.error is not None:
        kind, message = plan.error
        raise _ERRORS.get(kind, RuntimeError)(message)
    newest: tuple[str, str] | None = None
    skipped: list[str] = []
    for candidate in plan.candidates:
        problem, checkpoint = _verify(candidate, rank, world_size)
        problem = next((p for p in all_gather_object(problem, group) if p is not None), None)
        if problem is None:
            assert checkpoint is not None
            if skipped and rank == 0 and directory is not None:
                _set_aside_skipped(directory, skipped)
            return checkpoint, candidate.path, plan.rollback
        if plan.explicit:
            raise ValueError(_cannot_resume(candidate.path, problem))
        if rank == 0:
            logger.warning("skipping checkpoint %s: %s", candidate.path, problem)
        newest = newest or (candidate.path, problem)
        skipped.append(candidate.path)
    if newest is not None:  # a fresh start would prune them, and overwrite their names
        raise ValueError(_none_resumes(len(plan.candidates), *newest))
    return None


def _set_aside_skipped(directory: CheckpointDir, skipped: list[str]) -> None:
    """Move the newer checkpoints that could not be resumed out of the way of the run that
    goes on before them, which would write over their names and prune them."""
    names = [os.path.basename(p) for p in skipped if os.path.exists(p)]
    if names:
        aside = directory.set_aside(names)
        logger.warning(
            "the newer checkpoint(s) that could not be resumed (%s) were moved to %s: training "
            "goes on from an older one and would have written over them",
            ", ".join(names),
            aside,
        )


def _verify(
    candidate: Candidate, rank: int, world_size: int
) -> tuple[str | None, dict[str, Any] | None]:
    """Check this rank's share of ``candidate``'s files, then load its rest: what is wrong
    (naming the file) and ``None``, or ``None`` and the checkpoint."""
    try:
        problem = mismatch(sorted(candidate.checksums.items())[rank::world_size])
        if not candidate.checksums and os.path.isdir(candidate.path):  # a sharded one, unlisted
            checked_metadata(candidate.path, "its shards are not whole")
        return (problem, None) if problem else (None, load_checkpoint(candidate.path))
    except Exception as exc:  # missing, unreadable, not a checkpoint: agreed on as a mismatch
        unlisted = "" if candidate.checksums else " (not in the manifest: cut short?)"
        return f"{type(exc).__name__}: {first_line(exc, 200)}{unlisted}", None


def mismatch(checksums: Iterable[tuple[str, int]]) -> str | None:
    """The first of the files ``checksums`` names whose CRC-32 differs from the one given (the
    manifest's), described; ``None`` if they all match. A missing file raises ``OSError``."""
    for path, expected in checksums:
        if crc32(path) != expected:
            return f"{path}: its CRC-32 does not match the manifest (truncated?)"
    return None


def unverified(candidate: Candidate) -> str | None:
    """What is wrong with ``candidate``'s files (a CRC-32 that differs, a file missing),
    described; ``None`` if nothing is (its checksums all match)."""
    try:
        return mismatch(sorted(candidate.checksums.items()))
    except OSError as exc:  # a file the manifest lists is missing or unreadable
        return f"{type(exc).__name__}: {exc}"


def listed(path: str) -> Candidate:
    """``path`` with the checksums the manifest next to it records (none if it lists none)."""
    parent, name = os.path.split(os.path.abspath(path))
    entries = CheckpointDir(parent, keep=1).entries()
    entry = next((e for e in entries if e["file"] == name), None)
    return Candidate(path, {} if entry is None else expected_checksums(parent, entry))


def _plan_or_error(
    resume: bool | str | os.PathLike, directory: CheckpointDir | None, fetch: Fetch | None
) -> Plan:
    try:
        return _plan(resume, directory, fetch)
    except Exception as exc:  # every rank raises it, rank 0 included
        return Plan([], error=(type(exc).__name__, str(exc)))


def _plan(
    resume: bool | str | os.PathLike, directory: CheckpointDir | None, fetch: Fetch | None
) -> Plan:
    """Rank 0: what ``resume`` asks for, after the checks that need no other rank."""
    if resume == "auto":
        if directory is None:
            return Plan([])
        if fetch is not None:
            fetch(directory)
        entries, held = directory.entries(), directory.held()
        where, last = directory.directory, max((e["step"] for e in entries), default=-1)
        unlisted = sorted((step, name) for name, step in held.items() if step > last)
        if unlisted:  # written (renamed whole) but not recorded: the run stopped in between
            logger.warning(
                "%s holds %s, which its manifest does not list (the run stopped between writing "
                "and recording it): tried first, checked by loading (no checksum)",
                where,
                ", ".join(name for _, name in unlisted),
            )
        directory.adopt([e["file"] for e in entries] + [name for _, name in unlisted])  # its own
        return Plan(
            [Candidate(os.path.join(where, name), {}) for _, name in reversed(unlisted)]
            + [
                Candidate(os.path.join(where, entry["file"]), expected_checksums(where, entry))
                for entry in reversed(entries)
            ]
        )
    if resume is not False and not isinstance(resume, (str, os.PathLike)):
        raise ValueError(f"resume={resume!r}: pass 'auto', a checkpoint's path, or False")
    path = None if resume is False else os.fspath(resume)
    if path is not None and not os.path.exists(path):
        raise FileNotFoundError(
            f"resume={path!r}: no such checkpoint file or directory; pass an existing one, or "
            "resume='auto' (the newest valid one in the checkpoint directory)"
        )
    rollback = directory is not None and _check_may_start(directory, path)
    return Plan([]) if path is None else Plan([listed(path)], explicit=True, rollback=rollback)


def _check_may_start(directory: CheckpointDir, path: str | None) -> bool:
    """Refuse a run that would prune or overwrite checkpoints it does not continue: a fresh
    start (``path`` ``None``) or one from elsewhere where the directory holds checkpoints. One
    from a checkpoint of the directory older than others there first verifies it (checksums),
    then sets those aside: a rollback (``True``)."""
    held = directory.held()
    if not held:
        return False
    if path is None:
        _refuse(directory, "checkpoints", held, "a fresh start (resume=False)")
    name = os.path.basename(os.path.abspath(path))
    if name not in held or not _same_dir(path, directory.directory):
        _refuse(directory, "checkpoints", held, f"a run resumed from {path!r}")
    newer = sorted(other for other, step in held.items() if step > held[name])
    if newer:  # a rollback in place: the newer ones are kept, elsewhere, if it verifies
        problem = unverified(listed(path))
        if problem is not None:
            raise ValueError(_cannot_resume(path, f"{problem} (nothing was moved)"))
        aside = directory.set_aside(newer)
        logger.warning(
            "rolling back to %s: the %d newer checkpoint(s) of %s (%s) were moved to %s, with "
            "a manifest (resume from there to return to them)",
            path,
            len(newer),
            directory.directory,
            ", ".join(newer),
            aside,
        )
        held = directory.held()
    directory.adopt(held)  # it continues the newest: the directory's checkpoints are its own
    return bool(newer)


def _none_resumes(count: int, newest: str, problem: str) -> str:
    return (
        f"resume='auto': none of the {count} checkpoint(s) of {os.path.dirname(newest)} can "
        f"be resumed (the newest, {newest}: {problem}); they are left as they are, and training "
        "does not start afresh over them: repair or move them, or train with another "
        "save_path/checkpoint_dir"
    )


def _cannot_resume(path: str, problem: str) -> str:
    return (
        f"resume={path!r} cannot be resumed from: {problem}; pass another checkpoint, or "
        "resume='auto' (the newest valid one in the checkpoint directory)"
    )


def _refuse(directory: CheckpointDir, what: str, names: Iterable[str], run: str) -> NoReturn:
    ordered = sorted(names)
    shown = ", ".join(ordered[:3]) + (", ..." if len(ordered) > 3 else "")
    raise FileExistsError(
        f"the checkpoint directory {directory.directory!r} already holds {what} ({shown}), "
        f"which {run} would prune or overwrite: continue them with train(resume='auto'), "
        "use another save_path/checkpoint_dir, or delete the old checkpoints yourself"
    )


def _same_dir(path: str, directory: str) -> bool:
    """Whether ``path`` lies directly in ``directory`` (links resolved)."""
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.realpath(parent) == os.path.realpath(directory)
