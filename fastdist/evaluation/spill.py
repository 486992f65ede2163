"""Spill files of a prediction: each rank streams its outputs to a file in a directory every
rank sees; rank 0 merges them in dataset order, one record at a time."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

from fastdist.distributed import broadcast_object
from fastdist.distributed.storage import check_shared_dirs

#: ``writer(index, output)``: called on rank 0 for every sample in dataset order.
Writer = Callable[[int, Any], None]

_PREFIX = "fastdist-predict-"


def open_work_dir(
    shared_dir: str | os.PathLike | None,
    output_path: str | os.PathLike | None,
    rank: int,
    group: Any,
) -> str:
    """Rank 0 creates the spill directory; every rank checks it is shared, or all raise."""
    proposal: tuple[str, str | None] | None = None
    if rank == 0:
        work, error = "", None
        try:
            if output_path is not None:
                parent = os.path.dirname(os.path.abspath(output_path))
                if not os.path.isdir(parent):
                    raise FileNotFoundError(f"output_path's directory {parent!r} does not exist")
            work = tempfile.mkdtemp(prefix=_PREFIX, dir=shared_dir)  # mode 0o700
        except OSError as exc:
            error = f"rank 0 could not prepare the prediction: {exc}"
        proposal = (work, error)
    try:
        work, error = broadcast_object(proposal, src=0, group=group)
    except BaseException:
        if proposal is not None and proposal[0]:
            shutil.rmtree(proposal[0], ignore_errors=True)
        raise
    if error is not None:
        raise RuntimeError(error)
    try:
        check_shared_dirs([("shared_dir", work)], group)  # on several nodes: really shared?
    except BaseException:
        cleanup(work, rank, ())
        raise
    return work


def merge(
    work: str,
    n: int,
    world: int,
    as_json: bool,
    output_path: str | os.PathLike | None,
    writer: Writer | None,
) -> list[Any] | None:
    """On rank 0: read the spill files round-robin, one record at a time, in dataset order."""
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(open(spill_path(work, r, as_json), "r" if as_json else "rb"))
            for r in range(min(world, n))
        ]
        if output_path is not None:
            _write_lines(output_path, _json_lines(files, n))
            return None
        records = _records(files, n)
        if writer is not None:
            for index, item in records:
                writer(index, item)
            return None
        return [item for _index, item in records]


def _json_lines(files: list[IO[Any]], n: int) -> Iterator[str]:
    world = len(files)
    for index in range(n):
        line = files[index % world].readline()
        if not line.endswith("\n"):
            raise RuntimeError(f"the spill file of rank {index % world} ended early")
        yield line


def _records(files: list[IO[Any]], n: int) -> Iterator[tuple[int, Any]]:
    world = len(files)
    for index in range(n):
        try:
            got, item = pickle.load(files[index % world])
        except EOFError:
            raise RuntimeError(f"the spill file of rank {index % world} ended early") from None
        if got != index:
            raise RuntimeError(f"spill file of rank {index % world}: sample {got}, not {index}")
        yield index, item


def _write_lines(path: str | os.PathLike, lines: Iterator[str]) -> None:
    """Write ``lines`` to ``path`` through a temporary file renamed at the end."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.writelines(lines)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def spill_path(work: str, rank: int, as_json: bool) -> str:
    return os.path.join(work, f"rank{rank}.{'jsonl' if as_json else 'pkl'}")


def cleanup(work: str, rank: int, own: tuple[str, ...]) -> None:
    """Remove this rank's files (its own filesystem may differ); rank 0 removes ``work``."""
    for path in own:
        with contextlib.suppress(OSError):
            os.remove(path)
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
