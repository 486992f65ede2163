"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), for ``strategy="fsdp"``.

Layout of one checkpoint, a directory ``step-00000120/`` next to the manifest::

    .metadata, __0_0.distcp, __1_0.distcp ...   DCP: each rank's shard of the model and the
                                                optimizer state, written by that rank
    trainer.pt                                  everything else (trainer, callbacks, RNGs...),
                                                rank 0, torch.save of tensors and plain data

All ranks write into ``.tmp-step-00000120/``; once every rank has finished, rank 0 publishes it
with one rename, then updates the manifest. DCP reshards on load, so a checkpoint of N ranks
resumes on M (the one-process run holds plain tensors).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fastdist.distributed import is_distributed
from fastdist.trainer.checkpoint import fsync_dir


def _barrier(group: Any) -> None:
    if is_distributed():
        dist.barrier(group=group)


def write_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, tmp_dir: str, is_master: bool, group: Any
) -> None:
    """Every rank writes its shard of the model and optimizer state into ``tmp_dir``."""
    if is_master:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # a dead attempt's leftovers
        os.makedirs(tmp_dir)
    _barrier(group)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=tmp_dir,
        process_group=group,
    )


def publish(tmp_dir: str, final_dir: str, group: Any, is_master: bool) -> None:
    """After every rank finished writing: rank 0 renames ``tmp_dir`` to ``final_dir``."""
    _barrier(group)
    if is_master:
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        fsync_dir(os.path.dirname(final_dir))  # durable before the manifest names it


def load_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: str, group: Any = None
) -> None:
    """Load the model and optimizer state of ``path`` into this rank's (re)sharded tensors."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # DCP loads in place into these tensors, resharded to this run's layout.
    dcp.load(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=path,
        process_group=group,
    )
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
