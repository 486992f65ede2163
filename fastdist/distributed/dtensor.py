"""Whether a tensor is a DTensor, or a module is sharded by FSDP, without importing torch's
``torch.distributed.tensor`` and ``torch.distributed.fsdp`` (~0.6 s, which a DDP run never
needs): neither kind of object can exist before its package is imported."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs  # typing's from Python 3.13


def is_dtensor(obj: Any) -> TypeIs[DTensor]:
    """``isinstance(obj, DTensor)``."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def is_fsdp_module(obj: Any) -> TypeIs[FSDPModule]:
    """``isinstance(obj, FSDPModule)``: a module ``fully_shard`` sharded."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(obj, FSDPModule)


def piece(tensor: Any) -> tuple[tuple[int, int], ...]:
    """Which piece of its whole tensor ``tensor`` holds on this rank: ``(mesh dimension,
    coordinate)`` along each dimension a DTensor is split (or partial) over; ``()`` for a plain
    tensor. Ranks that hold the same piece of a parameter hold copies of it."""
    if not is_dtensor(tensor):
        return ()
    coordinate = tensor.device_mesh.get_coordinate()
    assert coordinate is not None  # a rank holding a DTensor is on its mesh
    return tuple(
        (d, coordinate[d]) for d, p in enumerate(tensor.placements) if not p.is_replicate()
    )


def local_shards(state: Any) -> Any:
    """``state`` (a nested dict/list of a sharded model's or optimizer's state) with every
    DTensor replaced by this rank's local shard: what a peer replica group's matching rank
    receives when it heals (torchft's checkpoint transport sends plain tensors)."""
    if is_dtensor(state):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_shards(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_shards(v) for v in state)
    return state


def as_shards(received: Any, mine: Any) -> Any:
    """The inverse of :func:`local_shards`: ``received`` with each local shard made a DTensor
    laid out as the DTensor in the same place of ``mine`` (this rank's own state)."""
    if is_dtensor(mine):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            received.to(mine.device),
            mine.device_mesh,
            mine.placements,
            shape=mine.shape,
            stride=mine.stride(),
            run_check=False,
        )
    if isinstance(received, dict) and isinstance(mine, dict):
        return {k: as_shards(v, mine.get(k)) for k, v in received.items()}
    if isinstance(received, (list, tuple)) and isinstance(mine, (list, tuple)):
        return type(received)(as_shards(r, m) for r, m in zip(received, mine, strict=False))
    return received
