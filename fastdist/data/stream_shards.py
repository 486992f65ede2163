"""How a stream is split among its readers (every DataLoader worker of every rank): each
reader keeps its items of the whole stream (:class:`StreamShard`), or the stream reads only its
own part and says so (:class:`ShardedStream`). :mod:`fastdist.data.stream` trains on them."""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info


def is_stateful(data: Any) -> bool:
    """Whether ``data`` can save and restore its position (torchdata's ``Stateful``)."""
    return callable(getattr(data, "state_dict", None)) and callable(
        getattr(data, "load_state_dict", None)
    )


class EpochCarrier(IterableDataset):
    """Wraps ``dataset`` so that :meth:`set_epoch` reaches the DataLoader workers reading it.

    A worker reads its own copy of the dataset, made when it started; a persistent worker
    (``persistent_workers=True``) never sees ``set_epoch`` called on the main process's. The
    epoch is kept in shared memory and handed to the worker's copy when it starts a pass.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._epoch = multiprocessing.RawValue("q", -1)  # -1: never set

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch, for a dataset that shuffles by it."""
        self._epoch.value = epoch

    def _at_epoch(self) -> Any:
        """The dataset, told the current epoch (in whichever process reads it)."""
        if self._epoch.value >= 0 and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self._epoch.value)
        return self.dataset


class StreamShard(EpochCarrier):
    """This reader's items of ``dataset``: item ``i`` if ``i % readers == reader``.

    Readers are the DataLoader workers of all ranks (``rank * workers + worker`` of
    ``world_size * workers``). Every reader iterates the whole stream and keeps its items, so
    any iterable can be sharded, at the cost of reading (not training on) everything
    ``readers`` times. Every rank must pass the same stream: one split per rank beforehand
    would be split again (wrap such a stream in :class:`ShardedStream`).
    """

    def __init__(self, dataset: Any, rank: int, world_size: int) -> None:
        super().__init__(dataset)
        self.rank, self.world_size = rank, world_size
        self._taken = False  # this reader kept an item since the (resumed) start
        self._ended = False  # this reader's iteration has ended
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        readers, reader = self.world_size * workers, self.rank * workers + worker
        dataset = self._at_epoch()
        resume, self._resume = self._resume, None
        first, self._taken, self._ended = reader, False, False
        if resume is not None:
            dataset.load_state_dict(resume["dataset"])
            self._taken, self._ended = resume["taken"], resume.get("ended", False)
            if self._taken:  # the dataset stands just after this reader's last item
                first = readers - 1
        if self._ended:  # its position may not say so: a stream may start anew at its end
            return iter(())
        return self._kept(itertools.islice(iter(dataset), first, None, readers))

    def _kept(self, items: Iterator[Any]) -> Iterator[Any]:
        for item in items:
            self._taken = True
            yield item
        self._ended = True

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position, whether this reader's first item is behind it and whether
        its iteration ended; or a state loaded and not yet read from (a DataLoader worker's
        snapshot may be taken then)."""
        if self._resume is not None:
            return self._resume
        return {"dataset": self.dataset.state_dict(), "taken": self._taken, "ended": self._ended}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next ``iter()``."""
        self._resume = state


class ShardedStream(EpochCarrier):
    """A stream that reads only this reader's part itself: fastdist takes it as it is.

    Wrap a dataset that splits its sources by data shard and DataLoader worker, as streaming
    libraries do by rank, so that it is not split a second time. The data shard is the rank
    among the ranks that train on different data (tensor-parallel peers share one): read it
    when the dataset is built, in the main process, from the strategy's layout
    (``Topology.of(strategy).data_shard``, :class:`fastdist.strategies.Topology`; without
    tensor parallelism it is the rank), say it here, and read the worker in ``__iter__``
    (``torch.utils.data.get_worker_info()``): ``__iter__`` runs in forked DataLoader workers,
    where torch.distributed must not be called (a worker that did stalled once in our tests).
    The parts may differ in length: the ranks still agree on every update and end the epoch
    together. ``state_dict``/``load_state_dict`` and ``set_epoch`` of the dataset are used as
    they are; the state saved adds whether this reader's iteration had ended.

    Args:
        dataset: the stream of this data shard's items.
        rank, size: the data shard it reads, of how many; the trainer checks them against its
            topology. ``None``: the rank and world size (refused where tensor-parallel peers
            share a shard).

    Example:
        >>> shard = Topology.of(FSDP()).data_shard  # of the strategy the trainer gets
        >>> part = range(shard.rank, 10, shard.size)  # a stream reading its own part
        >>> stream = ShardedStream(part, shard.rank, shard.size)
    """

    def __init__(self, dataset: Any, rank: int | None = None, size: int | None = None) -> None:
        super().__init__(dataset)
        self.rank, self.size = rank, size
        self._ended = False  # this reader's iteration has ended (or had, when resumed)
        self._skip = False  # a state loaded says it had ended: the next iteration reads nothing

    def check_shard(self, rank: int, size: int, world_size: int) -> None:
        """Raise unless this stream reads data shard ``rank`` of ``size`` (of ``world_size``
        ranks)."""
        given = (self.rank, self.size)
        if given == (None, None) and size == world_size:
            return
        if given != (rank, size):
            said = (
                "no data shard" if given == (None, None) else f"data shard {given[0]} of {given[1]}"
            )
            raise ValueError(
                f"ShardedStream says it reads {said}, but this rank trains on data shard "
                f"{rank} of {size} (tensor-parallel peers share one, and must read the same "
                "items): split the stream by Topology.of(strategy).data_shard, not by the rank, "
                "and pass ShardedStream(stream, shard.rank, shard.size)"
            )

    def __iter__(self) -> Iterator[Any]:
        self._ended, self._skip = self._skip, False
        return iter(()) if self._ended else self._read(iter(self._at_epoch()))

    def _read(self, items: Iterator[Any]) -> Iterator[Any]:
        yield from items
        self._ended = True

    def state_dict(self) -> dict[str, Any]:
        """The dataset's own state and whether this reader's iteration ended (a stream may
        start anew at its end, where its position cannot say so)."""
        return {"dataset": self.dataset.state_dict(), "ended": self._ended or self._skip}

    def load_state_dict(self, state: Any) -> None:
        if not (isinstance(state, dict) and state.keys() == {"dataset", "ended"}):
            state = {"dataset": state, "ended": False}  # saved by fastdist before 2026-11-27
        self.dataset.load_state_dict(state["dataset"])
        self._skip = state["ended"]
