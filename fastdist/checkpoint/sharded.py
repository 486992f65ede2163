"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), for parts held in shards.

Layout of one checkpoint, a directory ``step-00000120/`` next to the manifest::

    .metadata, __0_0.distcp, __1_0.distcp ...   DCP: each rank's shards of the sharded parts
                                                (model, optimizer), written by that rank
    trainer.pt                                  every other part (trainer, callbacks, RNGs...),
                                                rank 0, torch.save of tensors and plain data

All ranks write into ``.tmp-step-00000120/``; once every rank has finished, rank 0 publishes it
with one rename, then updates the manifest. DCP reshards on load, so a checkpoint of N ranks
resumes on M (the one-process run holds plain tensors).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fastdist.checkpoint.files import fsync_dir
from fastdist.distributed import is_distributed


def _barrier(group: Any) -> None:
    if is_distributed():
        dist.barrier(group=group)


def write_shards(state: dict[str, Any], tmp_dir: str, is_master: bool, group: Any) -> None:
    """Every rank writes its shards of ``state`` (``{part name: state dict}``) into
    ``tmp_dir``."""
    if is_master:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # a dead attempt's leftovers
        os.makedirs(tmp_dir)
    _barrier(group)
    dcp.save(state, checkpoint_id=tmp_dir, process_group=group)


def publish(tmp_dir: str, final_dir: str, group: Any, is_master: bool) -> None:
    """After every rank finished writing: rank 0 renames ``tmp_dir`` to ``final_dir``."""
    _barrier(group)
    if is_master:
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        fsync_dir(os.path.dirname(final_dir))  # durable before the manifest names it


def load_shards(state: dict[str, Any], path: str, group: Any = None) -> None:
    """Load ``path``'s shards in place into ``state`` (``{part name: state dict}`` of this
    run's tensors), resharded to this run's layout."""
    dcp.load(state, checkpoint_id=path, process_group=group)
