"""The layout of the ranks: one object per trainer owns it, with named dimensions.

A strategy says how many ranks it wants along each dimension (:meth:`Strategy.degrees
<fastdist.strategies.Strategy.degrees>`); :class:`Topology` lays the world out along them and
answers every question about the layout: this rank's data shard, whether it holds the loss,
which ranks hold copies of its parameters, and the ``DeviceMesh`` of any dimensions. The
dimensions, outermost first (rank ``r``'s coordinates are ``r`` written in these sizes, as
torch's ``init_device_mesh`` numbers a mesh):

* ``pp``: pipeline stages;
* ``dp_replicate``: groups holding the same parameters (DDP's ranks, HSDP's replica groups);
* ``dp_shard``: ranks that shard the parameters between them (FSDP);
* ``tp``: tensor-parallel peers (adjacent ranks), which run the same batches.

The batch is split over ``dp_replicate`` x ``dp_shard``. Nothing here makes a mesh until one
is asked for, so one process and DDP never pay for one.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from fastdist.distributed import get_rank, get_world_size

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The named dimensions, outermost first.
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
#: The dimensions the batch is split over.
BATCH = ("dp_replicate", "dp_shard")


class HasDegrees(Protocol):
    """What a topology is built from: a strategy's wanted sizes of the dimensions."""

    def degrees(self, world_size: int) -> dict[str, int]: ...


@dataclass(frozen=True)
class DataShard:
    """Which shard of the data a rank runs, of how many; ``primary``: this rank speaks for its
    tensor-parallel peers, which run the same batches (its outputs are kept, theirs not)."""

    rank: int
    size: int
    primary: bool = True

    def across_groups(self, replica_group: tuple[int, int]) -> DataShard:
        """This rank's shard among every replica group's ranks: group ``index`` of ``count``
        (``replica_group``) trains its own part of the data."""
        index, count = replica_group
        return DataShard(index * self.size + self.rank, count * self.size, self.primary)


class Topology:
    """This rank's place in the layout of ``world_size`` ranks along named dimensions.

    Read-only; the trainer's is ``trainer.topology`` (callbacks may ask it).

    Args:
        degrees: ``{dimension: size}`` of the dimensions the strategy runs on (the others are
            1); their product must be ``world_size``.
        rank, world_size: this process's place in the job.
        device_type: the device type of the meshes (``"cpu"``, ``"cuda"``).
        timeout: seconds the process groups of a mesh may wait (``None``: torch's default).

    Example:
        >>> topology = Topology({"dp_shard": 2, "tp": 2}, rank=3, world_size=4)
        >>> topology.data_shard  # tensor-parallel peers 2 and 3 share data shard 1
        DataShard(rank=1, size=2, primary=False)
        >>> topology.ranks_along(3, "tp")
        [2, 3]
        >>> Topology.of(FSDP()).data_shard  # before the trainer: from torchrun's env
        DataShard(rank=0, size=1, primary=True)
    """

    def __init__(
        self,
        degrees: Mapping[str, int],
        rank: int,
        world_size: int,
        device_type: str = "cpu",
        timeout: float | None = None,
    ) -> None:
        unknown = sorted(set(degrees) - set(DIMS))
        if unknown:
            raise ValueError(f"unknown mesh dimensions {unknown}: the dimensions are {DIMS}")
        self.dims = tuple(d for d in DIMS if d in degrees)  # the mesh's, outermost first
        self.sizes = {d: int(degrees.get(d, 1)) for d in DIMS}
        if math.prod(self.sizes.values()) != world_size:
            raise ValueError(
                f"the layout {dict(degrees)} holds {math.prod(self.sizes.values())} ranks, "
                f"but the world has {world_size}"
            )
        self.rank, self.world_size = rank, world_size
        self.device_type, self.timeout = device_type, timeout
        self._coords = self._unravel(rank)

    @classmethod
    def of(
        cls,
        strategy: HasDegrees,
        device_type: str = "cpu",
        timeout: float | None = None,
    ) -> Topology:
        """The layout ``strategy`` wants over this job (rank and world size from the process
        group, or from torchrun's environment before it forms)."""
        if not callable(getattr(strategy, "degrees", None)):
            raise TypeError(
                f"Topology.of takes a strategy object, got {strategy!r}: Topology.of(DDP()) for "
                "'ddp' or None, Topology.of(FSDP()) for 'fsdp' (from fastdist.strategies)"
            )
        world = get_world_size()
        return cls(strategy.degrees(world), get_rank(), world, device_type, timeout)

    def size(self, *dims: str) -> int:
        """How many ranks the dimensions ``dims`` span together."""
        return math.prod(self.sizes[d] for d in dims)

    def coordinate(self, dim: str) -> int:
        """This rank's coordinate along ``dim``."""
        return self._coords[dim]

    @property
    def data_shard(self) -> DataShard:
        """The shard of the data this rank trains, evaluates and predicts on: its place in
        ``dp_replicate`` x ``dp_shard``; the tensor-parallel peers of one shard share it."""
        rank = self.coordinate("dp_replicate") * self.sizes["dp_shard"]
        rank += self.coordinate("dp_shard")
        primary = self.coordinate("tp") == 0 and self.holds_loss
        return DataShard(rank, self.size(*BATCH), primary)

    @property
    def holds_loss(self) -> bool:
        """Whether this rank computes the loss (the last pipeline stage; every rank without
        one)."""
        return self.coordinate("pp") == self.sizes["pp"] - 1

    @property
    def loss_ranks(self) -> int:
        """How many ranks compute the loss: every rank of the last pipeline stage."""
        return self.world_size // self.sizes["pp"]

    @property
    def stage_group(self) -> Any:
        """The process group of this rank's pipeline (its stages); ``None`` without one."""
        return self.mesh("pp").get_group() if self.sizes["pp"] > 1 else None

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters are sharded over ``dp_shard`` (a strategy that runs on it, on
        more than one process)."""
        return "dp_shard" in self.dims and self.world_size > 1

    @property
    def copies(self) -> list[list[int]]:
        """Every group of ranks that hold copies of the same parameters (or shards): the ranks
        along ``dp_replicate``. (Tensor-parallel peers also hold copies of the parameters the
        plan leaves whole; the replica check groups each parameter's copies by its layout.)"""
        starts = [r for r in range(self.world_size) if self._unravel(r)["dp_replicate"] == 0]
        return [self.ranks_along(start, "dp_replicate") for start in starts]

    def ranks_along(self, rank: int, *dims: str) -> list[int]:
        """The ranks whose coordinates differ from ``rank``'s only along ``dims``, in order."""
        coords = self._unravel(rank)
        return [
            r
            for r in range(self.world_size)
            if all(v == coords[d] for d, v in self._unravel(r).items() if d not in dims)
        ]

    def mesh(self, *dims: str) -> DeviceMesh:
        """The ``DeviceMesh`` of ``dims`` (default: every dimension the strategy runs on).

        The whole mesh is made once per process and layout, on first use, and kept: DTensor
        caches its sharding decisions by mesh, and meshes of the same ranks compare equal
        whatever their process groups, so a later trainer's DTensors would otherwise be sent
        through a group torn down with an earlier trainer ("Could not resolve the process
        group"). Its groups time out like the first trainer's. Its slices are kept too: the
        loop asks for one every update (a pipeline's stages), and a slice is a new mesh."""
        whole = _mesh(self.device_type, self.dims, self.sizes, self.timeout)
        dims = dims or self.dims
        if dims == self.dims:
            return whole
        key = (id(whole), dims)  # the whole mesh is kept for good: its id is never reused
        if key not in _SLICES:
            _SLICES[key] = whole[dims]
        return _SLICES[key]

    def _unravel(self, rank: int) -> dict[str, int]:
        coords = {}
        for dim in reversed(DIMS):
            rank, coords[dim] = divmod(rank, self.sizes[dim])
        return coords

    def __repr__(self) -> str:
        shape = " x ".join(f"{d}={self.sizes[d]}" for d in self.dims)
        return f"Topology({shape or 'one process'}, rank={self.rank})"


#: The meshes made in this process, by device type and layout (see :meth:`Topology.mesh`).
_MESHES: dict[tuple[str, tuple[str, ...], tuple[int, ...]], DeviceMesh] = {}
#: Their slices, by the whole mesh and the dimensions sliced.
_SLICES: dict[tuple[int, tuple[str, ...]], DeviceMesh] = {}


def _mesh(
    device_type: str, dims: tuple[str, ...], sizes: dict[str, int], timeout: float | None
) -> DeviceMesh:
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("a device mesh needs the process group: ask the trainer's topology")
    shape = tuple(sizes[d] for d in dims)
    key = (device_type, dims, shape)
    if key not in _MESHES:
        override: dict[int | str, Any] | None = None
        if timeout is not None:
            override = {d: _options(timeout) for d in dims}
        _MESHES[key] = init_device_mesh(
            device_type, shape, mesh_dim_names=dims, backend_override=override
        )
    return _MESHES[key]


def _options(timeout: float) -> Any:
    """Process-group options of the default backend carrying ``timeout`` seconds."""
    from torch._C._distributed_c10d import Backend

    limit = datetime.timedelta(seconds=timeout)
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = limit
        return options
    return Backend.Options(dist.get_backend(), limit)
