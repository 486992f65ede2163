"""Barriers, rank-zero helpers and object collectives; no-ops in a one-process world."""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fastdist.distributed.env import (
    ensure_group,
    get_local_rank,
    get_node_rank,
    get_rank,
    get_world_size,
)
from fastdist.distributed.position import enter_on_every_rank

T = TypeVar("T")

# The fastdist logger (fastdist.logging configures it; this layer sits below it).
logger = logging.getLogger("fastdist")


def _several_processes() -> bool:
    """Whether collectives have peers (creating the group from torchrun's env if needed)."""
    return ensure_group() and get_world_size() > 1


def barrier() -> None:
    """Wait until every process reaches this point; does nothing in a one-process world. Where
    a process will not come, the others raise naming it: at once if its script ended, else
    after the group's timeout."""
    if _several_processes():
        enter_on_every_rank("fastdist.barrier", None)  # not a peer's exit: the group's timeout
        dist.barrier()


_rank_zero_first_calls = itertools.count()


@contextlib.contextmanager
def rank_zero_first(
    local: bool = True, log_every: float = 30.0, what: str = "rank_zero_first"
) -> Iterator[None]:
    """Run the block on rank 0 first while the other ranks wait, then on the others.

    The usual use is data preparation: rank 0 downloads or builds a cache, the others read it.
    The waiting ranks poll the rendezvous store rather than sit in a collective, so rank 0 may
    take longer than the collective timeout; they log a line every ``log_every`` seconds. If
    rank 0 raises inside the block, the waiting ranks raise too, within a fraction of a second,
    with rank 0's error.

    Args:
        local: let local rank 0 of every node go first (a cache on node-local disk);
            ``False`` lets only global rank 0 go first (a cache on a shared filesystem).
        log_every: seconds between "waiting for rank 0" lines on the waiting ranks.
        what: the block's name in those lines and in the error of a failed block.

    Example:
        >>> with rank_zero_first():  # rank 0 first, then the others (reading its cache)
        ...     data = samples(8)
    """
    if not _several_processes():
        yield
        return
    call = next(_rank_zero_first_calls)  # every rank makes the same sequence of calls
    first = (get_local_rank() if local else get_rank()) == 0
    who = f"local rank 0 of node {get_node_rank()}" if local else "rank 0"
    key = f"fastdist/rank_zero_first/{call}/{get_node_rank() if local else 'all'}"
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store
    if not first:
        _wait_for_key(store, key, who, log_every, what)
        yield
        return
    try:
        yield
    except BaseException as exc:
        store.set(key, f"error: {type(exc).__name__}: {exc}")
        raise
    store.set(key, "done")


def _wait_for_key(store: Any, key: str, who: str, log_every: float, what: str) -> None:
    start = last_line = time.monotonic()
    while not store.check([key]):
        time.sleep(0.05)
        if time.monotonic() - last_line >= log_every:
            last_line = time.monotonic()
            logger.warning("waiting for %s to finish %s (%.0f s)", who, what, last_line - start)
    value = store.get(key).decode()
    if value != "done":
        raise RuntimeError(f"{who} failed inside {what}, so this rank stops: {value}")


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


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Return the list of ``obj`` from every rank, indexed by rank (picklable objects)."""
    if not _several_processes():
        return [obj]
    gathered: list[Any] = [None] * get_world_size()
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def agree(step: Callable[[], T], group: Any) -> list[T]:
    """``step()`` on this rank, then a collective of ``group``: every rank's result, by rank;
    if ``step`` raised on any rank, every rank raises ``OSError`` with the message of the
    first that did (an ``OSError``'s own, else its type and message). Unlike :func:`agreed`,
    it turns any exception into that ``OSError`` and gathers the results (picklable)."""
    result, error = None, None
    try:
        result = step()
    except Exception as exc:
        error = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
    outcomes = all_gather_object((error, result), group)
    failed = next((error for error, _ in outcomes if error is not None), None)
    if failed is not None:
        raise OSError(failed)
    return [result for _, result in outcomes]


def agreed(action: Callable[[], T], group: Any = None) -> T:
    """``action()`` on this rank, then a collective: if it raised ``OSError`` on any rank (a
    full disk on rank 0), every rank raises an ``OSError`` with that rank's message."""
    error = None
    try:
        result = action()
    except OSError as exc:
        error = str(exc)
    failed = next((e for e in all_gather_object(error, group) if e is not None), None)
    if failed is not None:
        raise OSError(failed)
    return result


def gather_object(obj: Any, group: Any = None) -> list[Any] | None:
    """Return the list of ``obj`` from every rank on rank 0 (``None`` on the others)."""
    if not _several_processes():
        return [obj]
    gathered: list[Any] | None = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)  # every group holds all ranks
    return gathered


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Return rank ``src``'s ``obj`` on every rank (picklable objects)."""
    if not _several_processes():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Overwrite every tensor in place with rank ``src``'s values (internal)."""
    if _several_processes():
        for tensor in tensors:
            dist.broadcast(tensor, src=src, group=group)


def new_gloo_group(timeout: float | None) -> Any:
    """A gloo group of all ranks of its own (bounded by ``timeout`` seconds), for small host-side
    collectives that must neither wait for the GPU nor queue behind the trainer's; ``None`` in
    a one-process world. Call on every rank."""
    if not _several_processes():
        return None
    seconds = None if timeout is None else datetime.timedelta(seconds=timeout)
    return dist.new_group(backend="gloo", timeout=seconds)


def destroy_groups(groups: Iterable[Any]) -> None:
    """Tear down process groups this process created (never the default one): their sockets
    and threads. Local, no collective; ``None`` entries (no group) are skipped."""
    for group in groups:
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)


def start_all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> Callable[[], torch.Tensor]:
    """Start summing ``tensor`` over all ranks in place; the returned function waits for the
    sum and returns ``tensor`` (internal, one collective)."""
    if not _several_processes():
        return lambda: tensor
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return tensor

    return wait


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it (internal, one collective)."""
    if _several_processes():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
