"""How gradients cross torchft's replica groups, and each group's store.

Within a group the ranks run torch's own data parallelism over the group's process group
(torchrun's); across the groups each rank averages with the same rank of every other group
over torchft's managed ``ProcessGroupGloo`` (``Manager.allreduce``), which a failed peer
leaves uncommitted instead of raising:

* ``DDP(fault_tolerant=True)``: DDP's communication hook averages a bucket within the group,
  then across the groups (:func:`wrap_ddp`).
* ``FSDP(fault_tolerant=True)``: ``fully_shard`` shards within the group; each FSDP module's
  all-reduce hook averages its reduce-scattered gradient shard across the groups, as HSDP's
  replicate dimension would (:func:`reduce_across_groups`; torchtitan's torchft integration
  does the same).
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastdist.distributed import broadcast_object, get_rank, is_distributed


def wrap_ddp(manager: Any, model: nn.Module, group: Any) -> nn.Module:
    """``model`` under torch's DistributedDataParallel over this replica group's ``group``
    (a dummy one for a group of one process, as torchft's own DDP wrapper), whose gradients
    are averaged within the group, then over the quorum's groups by ``Manager.allreduce``.
    Its hook is not torchft's: in torchft 0.2.0 that one fails an assertion in the backward
    pass when a peer dies during the all-reduce, where the update must only be left
    uncommitted."""
    from torch.nn.parallel import DistributedDataParallel
    from torchft.process_group import ProcessGroupDummy

    within = (group or dist.group.WORLD) if is_distributed() else None
    ddp = DistributedDataParallel(
        model,
        process_group=within if within is not None else ProcessGroupDummy(0, 1),
        find_unused_parameters=True,
    )
    size = dist.get_world_size(within) if within is not None else 1
    ddp.register_comm_hook((manager, within, size), _all_reduce)
    return ddp


def _all_reduce(state, bucket):
    """Average ``bucket`` (a ``dist.GradBucket``) within the group, then over the quorum;
    return a done future. A failure across groups is reported to the Manager (the update is
    then not committed), not raised. Unannotated: DDP checks a hook's annotations, and this
    module's are strings."""
    manager, within, size = state
    buffer = bucket.buffer()
    if within is not None:
        dist.all_reduce(buffer, group=within)
        buffer /= size
    manager.allreduce(buffer).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


def reduce_across_groups(manager: Any, model: nn.Module) -> None:
    """Average every FSDP module's reduce-scattered gradient shard across the groups."""
    from torch.distributed.fsdp import FSDPModule

    def hook(output: torch.Tensor) -> None:
        manager.allreduce(output).wait()  # a failure: reported, the update not committed

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)


def group_store(group: Any) -> tuple[str, int]:
    """A TCPStore for torchft's Manager, new at each start of the group (a restarted group
    must not read the dead attempt's keys from torchrun's store): hosted by the group's rank
    0 (one process alone: its own), its address sent to the others (a collective)."""
    from torch.distributed import TCPStore

    address = None
    if get_rank() == 0:
        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        _STORES.append(store)  # kept alive with the process
        # The host name torchft's Manager advertises its own server under.
        host = socket.gethostname() if is_distributed() else "127.0.0.1"
        address = (host, int(store.port))
    if is_distributed():
        address = broadcast_object(address, group=group)
    assert address is not None
    return address


_STORES: list[Any] = []
