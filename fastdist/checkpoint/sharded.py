"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), for parts held in shards.

Layout of one checkpoint, a directory ``step-00000120/`` next to the manifest::

    .metadata, __0_0.distcp, __1_0.distcp ...   DCP: each rank's shards of the sharded parts
                                                (model, optimizer), written by that rank
    trainer.pt                                  every other part (trainer, callbacks, RNGs...),
                                                rank 0, torch.save of tensors and plain data

All ranks write into ``.tmp-step-00000120/`` (in the background with ``checkpoint_async``: DCP's
``async_save``), which rank 0 holds locked meanwhile (:mod:`fastdist.checkpoint.temps`), and
checksum what they wrote; once every rank has finished, rank 0 publishes it with one rename,
then records it and the CRC-32 of each of its files in the manifest. DCP reshards on load, so a
checkpoint of N ranks resumes on M (the one-process run holds plain tensors).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from fastdist.checkpoint.files import crc32, fsync_dir
from fastdist.checkpoint.temps import lock_temp
from fastdist.checks import first_line
from fastdist.distributed import is_distributed

_SHARD_FILE = re.compile(r"__(\d+)_")  # DCP's FileSystemWriter names rank R's files __R_*
_locks: dict[str, int] = {}  # rank 0's temp folders being written, by path: their locks


def _barrier(group: Any) -> None:
    if is_distributed():
        dist.barrier(group=group)


def write_shards(
    state: dict[str, Any], tmp_dir: str, is_master: bool, group: Any, stager: Any = None
) -> Callable[[], dict[str, int]]:
    """Start every rank's write of its shards of ``state`` (``{part name: state dict}``) into
    ``tmp_dir``; return the function that finishes it: the CRC-32 of each file this rank
    wrote, by name (rank 0: with ``.metadata`` and any file DCP names otherwise). DCP raises
    ``CheckpointException`` there, on every rank, if any rank's write failed.

    With DCP's ``stager`` (a background write), ``async_save`` copies the shards to memory now
    with it and writes them in a thread of its own, which the returned function waits for;
    else that function writes them.
    """
    import torch.distributed.checkpoint as dcp  # ~0.7 s with DTensor: sharded checkpoints only

    if is_master:
        discard(tmp_dir)  # a dead attempt's leftovers
        os.makedirs(tmp_dir)
        _locks[tmp_dir] = lock_temp(tmp_dir)
    _barrier(group)
    save: Callable[[], Any]
    if stager is not None:
        written = dcp.async_save(
            state, checkpoint_id=tmp_dir, process_group=group, async_stager=stager
        )
        assert isinstance(written, Future)  # an AsyncSaveResponse only with an async stager
        save = written.result
    else:
        save = functools.partial(dcp.save, state, checkpoint_id=tmp_dir, process_group=group)
    rank = dist.get_rank(group) if is_distributed() else 0

    def finish() -> dict[str, int]:
        # Once DCP's save returns on any rank, every rank's files and the metadata are written.
        # The folder names them; the returned metadata's storage_data is None in torch 2.11.
        save()
        mine = sorted(name for name in os.listdir(tmp_dir) if _writer(name) == rank)
        return {name: crc32(os.path.join(tmp_dir, name)) for name in mine}

    return finish


def _writer(name: str) -> int:
    """The rank that wrote the DCP file ``name``, so that it checksums the file while it is
    in its page cache; rank 0 for a name of another form."""
    match = _SHARD_FILE.match(name)
    return int(match.group(1)) if match else 0


def publish(tmp_dir: str, final_dir: str) -> None:
    """Rank 0, once every rank has finished writing: rename ``tmp_dir`` to ``final_dir``."""
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(tmp_dir, final_dir)
    _unlock(tmp_dir)
    fsync_dir(os.path.dirname(final_dir))  # durable before the manifest names it


def discard(tmp_dir: str) -> None:
    """Rank 0, after a failed write: remove ``tmp_dir`` (nothing names its shards)."""
    shutil.rmtree(tmp_dir, ignore_errors=True)
    _unlock(tmp_dir)


def _unlock(tmp_dir: str) -> None:
    fd = _locks.pop(tmp_dir, None)
    if fd is not None:
        os.close(fd)


def load_shards(state: dict[str, Any], path: str, group: Any = None) -> None:
    """Load ``path``'s shards in place into ``state`` (``{part name: state dict}`` of this
    run's tensors), resharded to this run's layout. DCP gathers every rank's read errors, so
    a shard that does not load raises on every rank."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except Exception as exc:
        raise ValueError(
            f"the shards of checkpoint {path} do not load ({type(exc).__name__}: {exc}); "
            "resume from another checkpoint"
        ) from exc


def checked_metadata(path: str, fix: str) -> Any:
    """The DCP metadata of the sharded checkpoint ``path``, once every shard it names is there
    and long enough; else a ``ValueError`` naming the file and ending with ``fix`` (DCP's own
    errors name no file)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # truncated, empty
        raise ValueError(
            f"{os.path.join(path, '.metadata')} cannot be read ({type(exc).__name__}: "
            f"{first_line(exc)}); {fix}"
        ) from exc
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = os.path.join(path, name)
        held = os.path.getsize(shard) if os.path.isfile(shard) else 0
        if held < size:
            raise ValueError(
                f"{shard} is truncated or missing: {held} bytes where the checkpoint's "
                f"metadata needs {size}; {fix}"
            )
    return metadata
