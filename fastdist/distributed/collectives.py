"""Barriers, rank-zero helpers and object collectives; no-ops in a one-process world."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fastdist.distributed.env import ensure_group, get_local_rank, get_rank, get_world_size

T = TypeVar("T")


def _several_processes() -> bool:
    """Whether collectives have peers (creating the group from torchrun's env if needed)."""
    return ensure_group() and get_world_size() > 1


def barrier() -> None:
    """Wait until every process reaches this point; does nothing in a one-process world."""
    if _several_processes():
        dist.barrier()


@contextlib.contextmanager
def rank_zero_first(local: bool = True) -> Iterator[None]:
    """Run the block on rank 0 first while the other ranks wait, then on the others.

    The usual use is data preparation: rank 0 downloads or builds a cache, the others read it.

    Args:
        local: let local rank 0 of every node go first (a cache on node-local disk);
            ``False`` lets only global rank 0 go first (a cache on a shared filesystem).

    Example:
        >>> with rank_zero_first():
        ...     data = build_or_load_cached("cache/")
    """
    first = (get_local_rank() if local else get_rank()) == 0
    if not first:
        barrier()
    yield
    if first:
        barrier()


def rank_zero_only(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Decorate ``fn`` to run on global rank 0 only; other ranks get ``None``.

    Example:
        >>> @rank_zero_only
        ... def save_report(path): ...
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T | None:
        return fn(*args, **kwargs) if get_rank() == 0 else None

    return wrapper


def all_gather_object(obj: Any) -> list[Any]:
    """Return the list of ``obj`` from every rank, indexed by rank (picklable objects)."""
    if not _several_processes():
        return [obj]
    gathered: list[Any] = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return rank ``src``'s ``obj`` on every rank (picklable objects)."""
    if not _several_processes():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite every tensor in place with rank ``src``'s values (internal)."""
    if _several_processes():
        for tensor in tensors:
            dist.broadcast(tensor, src=src)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it (internal, one collective)."""
    if _several_processes():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
